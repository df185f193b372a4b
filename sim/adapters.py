"""The simulator's one window into pdserve's internals (schedulers, BlockManager, link
scheduler, the worker configs of cluster/launch/worker_specs.py, router constants, engine
bookkeeping).

Every other sim/ module imports pdserve code only through this file (besides bench's
workload, metrics and trace helpers, and sim/cli.py reading `serve`'s flags from
cluster/config/flags.py at parser-build time, where this module's torch import would make
`pdserve --help` slow), so when those internals move the imports are fixed here alone.
Where the simulator must reproduce what a Ray-bound or torch-bound component does (the
launcher's router config, the decode engine's KV intake), the mirror lives here, next to
the name of the function it mirrors.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from cluster.config.flags import add_cli_flags, config_from_args
from cluster.config.serve import ServeConfig
from cluster.launch.worker_specs import (
    decode_config,
    engine_config,
    prefill_config,
    router_config,
    transfer_config,
)
from cluster.router.admission import RETRY_S as ADMISSION_RETRY_S
from cluster.router.admission import AdmissionCore, Waiter
from cluster.router.flight import RouterConfig
from cluster.router.policies import (
    BUCKET_NAMES,
    DECODE_ORDERS,
    PREFILL_PLACEMENTS,
    DecodeLoad,
    PrefillLoad,
    decode_order,
    default_placement,
    make_placement,
)
from cluster.router.pool import ReservesInFlight, has_room
from decode_worker.scheduler import DecodeScheduler, DecodeSchedulerConfig
from engine.block_manager import BlockManager, block_hashes
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.execute import Sampled, ScheduledItem, StepLaunch
from engine.memory import num_kv_blocks
from engine.request import Request, RequestStatus, SamplingParams
from engine.tracing import TraceEvent
from kv_transfer.base import KVChunk, KVSender, SendEvents
from kv_transfer.config import TransferConfig
from kv_transfer.link_scheduler import LinkScheduler
from kv_transfer.send_queue import QueuedFrame
from prefill_worker.engine import PrefillEngine
from prefill_worker.scheduler import PrefillScheduler, PrefillSchedulerConfig
from runtime.loop import WorkerLoop
from runtime.messages import DecodeTask, EventKind, PrefillTask, WorkerEvent

__all__ = [
    "ADMISSION_RETRY_S", "AdmissionCore", "BUCKET_NAMES", "DECODE_ORDERS", "IDLE_WAIT_S", "PREFILL_PLACEMENTS",
    "BlockManager", "block_hashes", "DecodeLoad", "DecodeScheduler", "DecodeTask", "EventKind",
    "KVChunk", "KVSender", "LinkScheduler", "PrefillEngine", "PrefillLoad", "PrefillScheduler",
    "PrefillTask", "QueuedFrame", "Request", "RequestStatus", "ReservesInFlight", "RouterConfig",
    "Sampled", "ScheduledItem", "SendEvents", "ServeConfig", "StepLaunch", "TraceEvent", "Waiter",
    "WorkerEvent", "WorkerPlan", "add_cli_flags", "config_from_args", "decode_order", "decode_task",
    "default_placement", "empty_payload", "engine_tools", "has_room", "kv_bytes_per_token",
    "make_placement", "model_config", "piece_layout", "plan_workers", "prefill_task",
    "resolve_model_dir", "simulated_token", "startable", "take_kv_piece", "weight_bytes",
]

# The worker loop's nap while it waits on I/O (runtime/loop.py WorkerLoop).
IDLE_WAIT_S: float = inspect.signature(WorkerLoop.__init__).parameters["idle_wait_s"].default
SIM_TOKEN = 1  # the id of every simulated output token (outputs run to max_tokens)
ELEM = {"float32": 4, "float16": 2, "bfloat16": 2}


def model_config(shape: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from a calibration's ``model`` record (architecture facts only)."""
    keys = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")
    missing = [k for k in keys if k not in shape]
    if missing:
        raise ValueError(f"model record lacks {missing}")
    return ModelConfig(**{k: shape[k] for k in keys}, rms_norm_eps=1e-6,
                       tie_word_embeddings=bool(shape.get("tie_word_embeddings", False)),
                       qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)


def kv_bytes_per_token(shape: Mapping[str, Any], dtype: str) -> int:
    """K+V bytes of one token over all layers (engine.kv_cache.KVCache.bytes_per_token)."""
    return shape["num_layers"] * 2 * shape["num_kv_heads"] * shape["head_dim"] * ELEM[dtype]


def weight_bytes(shape: Mapping[str, Any], dtype: str) -> int:
    h, inter, L = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    nh, nkv, d, v = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"], shape["vocab_size"]
    dense = L * (2 * h * nh * d + 2 * h * nkv * d + 3 * h * inter)
    return (dense + v * h * (1 if shape.get("tie_word_embeddings") else 2)) * ELEM[dtype]


@dataclass(frozen=True)
class WorkerPlan:
    """Everything the simulated workers, links and router are built from."""

    prefill_engine: EngineConfig  # the prefill worker's (its model, cache and limits)
    prefill: PrefillSchedulerConfig
    decode: DecodeSchedulerConfig
    prefill_blocks: int
    decode_blocks: int
    prefill_block_size: int
    decode_block_size: int
    prefix_caching: bool
    transfer: TransferConfig
    router: RouterConfig
    max_model_len: int
    num_layers: int
    kv_bytes_per_token: int


def plan_workers(cfg: ServeConfig, shape: Mapping[str, Any], dtype: str,
                 gpu_memory_bytes: float | None) -> WorkerPlan:
    """What cluster/launch/worker_specs.py gives each worker and cluster/launch/launcher.py the router
    for ``cfg`` (the same functions; the model and dtype from the calibration);
    ``gpu_memory_bytes`` None sizes KV as on a CPU."""
    c = cfg.cache
    device = "cuda" if gpu_memory_bytes else "cpu"
    # (no emulated device: the simulator charges every KV byte itself, so an emulated
    # service's --emulate-kv-fraction must not scale its links and windows)
    cfg = replace(cfg, model=replace(cfg.model, dtype=dtype, device=device, emulate=None,
                                     emulate_kv_fraction=1.0))
    model = model_config(shape)
    kvb = kv_bytes_per_token(shape, dtype)

    def blocks(role: str) -> tuple[EngineConfig, int, int, bool]:
        ecfg = engine_config(cfg, "<simulated>", role, 1.0, model)
        if not gpu_memory_bytes or c.num_blocks is not None:
            n = num_kv_blocks(ecfg)
        else:
            total = int(gpu_memory_bytes)
            n = num_kv_blocks(ecfg, memory=(total, total, 0),
                              pending_bytes=weight_bytes(shape, dtype))
        return ecfg, n, ecfg.cache.block_size, ecfg.cache.enable_prefix_caching

    (pcfg, pn, pbs, prefix), (_, dn, dbs, _) = blocks("prefill"), blocks("decode")
    max_len = engine_config(cfg, "<simulated>", "decode", 1.0, model).scheduler.max_model_len
    router = router_config(cfg, pbs)  # the service's router settings
    return WorkerPlan(
        prefill_engine=pcfg, prefill=prefill_config(cfg), decode=decode_config(cfg, max_len),
        prefill_blocks=pn, decode_blocks=dn, prefill_block_size=pbs, decode_block_size=dbs,
        prefix_caching=prefix, transfer=transfer_config(cfg, model, b"s" * 32),
        router=router, max_model_len=max_len, num_layers=shape["num_layers"],
        kv_bytes_per_token=kvb)


@lru_cache(maxsize=4096)
def _sampling(max_tokens: int) -> SamplingParams:
    """The router's greedy params for a leg (frozen: one per max_tokens is shared)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prefill_task(leg_id: str, tokens: list[int], max_tokens: int, tenant: str, dest: str,
                 deadline_s: float | None) -> PrefillTask:
    """The PrefillTask the router's dispatch sends for a leg (outputs run to max_tokens)."""
    return PrefillTask(leg_id, tuple(tokens), _sampling(max_tokens), dest, tenant=tenant,
                       ttft_deadline_s=deadline_s)


@lru_cache(maxsize=8192)
def empty_payload(num_tokens: int) -> Any:
    """A KVChunk payload of ``num_tokens`` tokens and no bytes (the simulator moves sizes)."""
    import torch

    return torch.empty((0, 2, num_tokens, 0, 0), dtype=torch.uint8)


def decode_task(leg_id: str, prompt_len: int, max_tokens: int, tenant: str) -> DecodeTask:
    """The DecodeTask the router's dispatch sends for a leg."""
    return DecodeTask(leg_id, prompt_len, _sampling(max_tokens), tenant=tenant)


@lru_cache(maxsize=8192)
def piece_layout(num_tokens: int, num_layers: int, bytes_per_token: int,
                 max_payload_bytes: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """How kv_transfer.wire.split_chunk cuts a chunk of ``num_tokens`` tokens: one
    ``(nbytes, token_offset, tokens, layer_start, layer_end)`` per frame piece. Runs the
    real split on an uncommitted CPU tensor of the chunk's shape (bytes as uint8)."""
    import torch

    from kv_transfer.base import KVChunk
    from kv_transfer.wire import split_chunk

    per_layer_token = bytes_per_token // num_layers // 2
    payload = torch.empty((num_layers, 2, num_tokens, 1, per_layer_token), dtype=torch.uint8)
    chunk = KVChunk("layout", 0, 0, num_tokens, payload, is_final=True, first_token=0)
    return tuple((p.nbytes, p.chunk.token_start, p.chunk.num_tokens, p.chunk.layer_start,
                  p.chunk.layer_end) for p in split_chunk(chunk, max_payload_bytes))


def take_kv_piece(sched: DecodeScheduler, leg_id: str, token_start: int, token_end: int,
                  layer_end: int, num_layers: int, first_token: int | None) -> bool:
    """decode_worker/engine.py DecodeEngine._write for one arrived piece (its payload
    import is a cost, not done here); False when the leg is not pending (discarded).
    ``first_token`` is set on the final piece only, which the sender queues last."""
    p = sched.pending.get(leg_id)
    if p is None:
        return False
    if token_end > token_start:
        sched.allocate_range(leg_id, token_end)
        key, ranges = (token_start, token_end), p.ranges
        assert ranges is not None  # (DecodeScheduler.reserve gives every pending leg a set)
        if layer_end == num_layers and key not in ranges:
            ranges.add(key)
            p.received_tokens += token_end - token_start
    if first_token is not None:
        p.first_token = first_token
        p.complete = True  # frames of a leg travel in order: the final one is the last
    return True


def startable(sched: DecodeScheduler) -> list[str]:
    """Pending legs whose KV and first token are all in (DecodeEngine._take_kv)."""
    out = []
    for leg_id, p in sched.pending.items():
        if p.complete and p.first_token is not None:
            if p.received_tokens < p.request.num_prompt_tokens:
                raise AssertionError(f"{leg_id}: KV incomplete ({p.received_tokens} of "
                                     f"{p.request.num_prompt_tokens} tokens) in the simulator")
            out.append(leg_id)
    return out


def simulated_token() -> int:
    return SIM_TOKEN


# ---- calibration: the real engine pieces, imported when `pdserve calibrate` runs ----------
def engine_tools():
    """The engine, sampler, KV cache, connectors and worker engines calibration times."""
    from types import SimpleNamespace

    from decode_worker.engine import DecodeEngine
    from engine.loader import load_model_config
    from engine.model_runner import ModelRunner, SeqChunk
    from engine.sampler import sample
    from kv_transfer.base import KVChunk
    from kv_transfer.registry import make_receiver, make_sender
    from prefill_worker.engine import PrefillEngine
    from runtime.messages import PrefillTask

    return SimpleNamespace(
        DecodeEngine=DecodeEngine, PrefillEngine=PrefillEngine, ModelRunner=ModelRunner,
        SeqChunk=SeqChunk, sample=sample, KVChunk=KVChunk, make_sender=make_sender,
        make_receiver=make_receiver, load_model_config=load_model_config,
        PrefillTask=PrefillTask, DecodeTask=DecodeTask, SamplingParams=SamplingParams,
        EngineConfig=EngineConfig, CacheConfig=CacheConfig, SchedulerConfig=SchedulerConfig,
        PrefillSchedulerConfig=PrefillSchedulerConfig, DecodeSchedulerConfig=DecodeSchedulerConfig,
        TransferConfig=TransferConfig)


def resolve_model_dir(path: str) -> str:
    """'tiny', 'smollm2' or a directory, as `pdserve serve --model` takes it."""
    from cluster.config.serve import ModelSection

    return str(ModelSection(path=path).resolve_path())
