"""How many KV blocks an engine gets.

On CPU: `cache.kv_cache_memory_bytes`. On a GPU, what the device has room for, as vLLM
sizes it: this worker may hold `gpu_memory_utilization x total x gpu_share` bytes
(`gpu_share` < 1 when workers share the GPU), minus what it holds already (the weights,
measured once they are loaded) and a reserve for activations and for what the runner
allocates after the cache (CUDA-graph block tables); never more than is free
on the device now. Both are capped by what `max_num_seqs` sequences of `max_model_len`
tokens could ever use.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.compile import graph_table_bytes, runner_mode
from engine.config import EngineConfig, ModelConfig, SchedulerConfig, Shard, torch_dtype
from engine.kv_cache import KVCache

MIN_RESERVE_BYTES = 256 << 20  # allocator slack, cuBLAS workspaces, sampler temporaries


def activation_reserve_bytes(model: ModelConfig, sched: SchedulerConfig, dtype: torch.dtype
                             ) -> int:
    """Peak activation memory of one step, generously: a step's token budget through the
    widest layer (q/k/v, gate/up, attention output, residual) and the fp32 logits and
    sampler temporaries of `max_num_seqs` rows."""
    elem = torch.empty((), dtype=dtype).element_size()
    width = (2 * model.intermediate_size + 4 * model.hidden_size
             + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim)
    hidden = sched.max_num_batched_tokens * width * elem * 2
    logits = sched.max_num_seqs * model.vocab_size * 4 * 6
    return hidden + logits + MIN_RESERVE_BYTES


def runner_reserve_bytes(cfg: EngineConfig) -> int:
    """What the runner allocates on the device after the KV cache: the block tables of
    its CUDA-graph decode steps (engine.compile.graph_table_bytes)."""
    s = cfg.scheduler
    return graph_table_bytes(runner_mode(cfg.compile, cfg.tensor_parallel_size),
                             torch.device(cfg.device), s.max_num_seqs, s.max_model_len,
                             cfg.cache.block_size)


def gpu_kv_budget(*, free: int, total: int, held: int, pending: int, utilization: float,
                  share: float, reserve: int) -> int:
    """KV bytes a worker may allocate on a GPU with `free` of `total` bytes free, holding
    `held` bytes and about to load `pending` more (weights not loaded yet): its share of
    `utilization x total` minus all that and `reserve`, and no more than is free."""
    mine = int(total * utilization * share) - held - pending - reserve
    return max(0, min(mine, free - pending - reserve))


def weight_bytes(model_dir: str | Path, dtype: torch.dtype) -> int:
    """Bytes the checkpoint's tensors take in `dtype`, from the safetensors headers."""
    from safetensors import safe_open

    from engine.loader import weight_files

    elem = torch.empty((), dtype=dtype).element_size()
    n = 0
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if not name.endswith("rotary_emb.inv_freq"):
                    shape = f.get_slice(name).get_shape()
                    n += int(torch.Size(shape).numel()) * elem
    return n


def device_memory(device: torch.device) -> tuple[int, int, int]:
    """(free, total, held by this process's allocator) bytes of a CUDA device. What the
    caching allocator keeps but no tensor uses (e.g. the weights `fuse()` replaced by
    fused copies) is handed back first: it is neither held nor taken from `free`."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total), int(torch.cuda.memory_reserved(device))


def rank_model(cfg: EngineConfig) -> ModelConfig:
    """The model as one tensor-parallel rank holds it (its KV heads: the same count on
    every rank); the whole model without TP."""
    return Shard.of(cfg.model, cfg.tensor_parallel_size).local_config(cfg.model)


def num_kv_blocks(cfg: EngineConfig, *, memory: tuple[int, int, int] | None = None,
                  pending_bytes: int = 0) -> int:
    """Blocks for `cfg` (see the module doc). `memory`: (free, total, held) of the GPU,
    required when `cfg.device` is a CUDA device and `cfg.cache.num_blocks` is unset;
    `pending_bytes`: weights still to be loaded when sizing before loading them."""
    c, s = cfg.cache, cfg.scheduler
    if c.num_blocks is not None:
        return c.num_blocks
    dtype = torch_dtype(cfg.dtype)
    per_block = KVCache.bytes_per_block(rank_model(cfg), c.block_size, dtype)
    per_seq = -(-s.max_model_len // c.block_size)
    cap = per_seq * s.max_num_seqs
    if not cfg.device.startswith("cuda"):
        return int(min(max(1, c.kv_cache_memory_bytes // per_block), cap))
    if memory is None:
        raise ValueError(f"sizing the KV cache on {cfg.device} needs the device's memory")
    free, total, held = memory
    reserve = activation_reserve_bytes(cfg.model, s, dtype) + runner_reserve_bytes(cfg)
    budget = gpu_kv_budget(free=free, total=total, held=held, pending=pending_bytes,
                           utilization=c.gpu_memory_utilization, share=c.gpu_share,
                           reserve=reserve)
    if budget < per_block:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache on {cfg.device}: {free / gib:.2f} of "
            f"{total / gib:.2f} GiB free, this worker holds {held / gib:.2f} GiB"
            f"{f' and loads {pending_bytes / gib:.2f} GiB of weights' if pending_bytes else ''}"
            f", {reserve / gib:.2f} GiB reserved for activations; its limit is "
            f"gpu_memory_utilization={c.gpu_memory_utilization:g} x gpu_share="
            f"{c.gpu_share:g} of the GPU. Raise cache.gpu_memory_utilization, give the "
            "worker more of the GPU, or lower scheduler.max_num_batched_tokens")
    return int(min(budget // per_block, cap))


def check_kv_fits(cfg: EngineConfig, num_blocks: int, *, free: int) -> None:
    """A clear error, instead of an out-of-memory one, when `num_blocks` blocks (planned
    before the weights were loaded, or set by hand) no longer fit in the `free` bytes."""
    per_block = KVCache.bytes_per_block(rank_model(cfg), cfg.cache.block_size,
                                        torch_dtype(cfg.dtype))
    need = num_blocks * per_block + MIN_RESERVE_BYTES
    if need > free:
        gib = 1 << 30
        raise ValueError(
            f"a KV cache of {num_blocks} blocks needs {need / gib:.2f} GiB on {cfg.device} "
            f"but {free / gib:.2f} GiB are free after loading the weights: lower "
            "cache.num_blocks or cache.gpu_memory_utilization")
