"""KV cache sizing: CPU from kv_cache_memory_bytes; a GPU from its memory (stubbed
`torch.cuda.mem_get_info`) after the weights are loaded, times gpu_memory_utilization,
split among the workers that share the GPU; the credit window floor from the model's
bytes per prefill chunk."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cluster.config.serve import ServeConfig
from cluster.launch.worker_specs import credit_window_bytes
from engine import memory
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_cache import KVCache
from engine.loader import load_model_config

GiB = 1 << 30


def cfg_for(model_dir, device="cuda:0", dtype="bfloat16", **cache) -> EngineConfig:
    model = load_model_config(model_dir)
    return EngineConfig(str(model_dir), model, CacheConfig(block_size=16, **cache),
                        SchedulerConfig(max_model_len=4096, max_num_seqs=64), device=device,
                        dtype=dtype)


def test_gpu_budget_is_the_share_minus_what_is_held_and_never_more_than_free():
    kw = dict(total=100 * GiB, held=10 * GiB, pending=0, reserve=GiB)
    assert memory.gpu_kv_budget(free=80 * GiB, utilization=0.9, share=1.0, **kw) == 79 * GiB
    # another process holds most of the GPU: only what is free now
    assert memory.gpu_kv_budget(free=20 * GiB, utilization=0.9, share=1.0, **kw) == 19 * GiB
    # two workers share the GPU: each plans half of 90 GiB
    assert memory.gpu_kv_budget(free=80 * GiB, utilization=0.9, share=0.5, **kw) == 34 * GiB
    # sized before loading: the weights to come count like held ones
    before = dict(kw, held=0, pending=10 * GiB)
    assert memory.gpu_kv_budget(free=90 * GiB, utilization=0.9, share=1.0, **before) == 79 * GiB
    assert memory.gpu_kv_budget(free=GiB, utilization=0.9, share=1.0, **kw) == 0


def test_workers_sharing_a_gpu_stay_within_the_utilization_together(tiny_model):
    total = 80 * GiB
    weights = memory.weight_bytes(tiny_model, torch.bfloat16)
    per_block = KVCache.bytes_per_block(load_model_config(tiny_model), 16, torch.bfloat16)
    cfg = cfg_for(tiny_model, gpu_share=0.5, gpu_memory_utilization=0.8)
    big = replace(cfg, scheduler=replace(cfg.scheduler, max_model_len=1 << 22))  # no cap
    free = total
    used = 0
    for _ in range(2):  # the second worker starts after the first took its share
        n = memory.num_kv_blocks(big, memory=(free, total, 0), pending_bytes=weights)
        used += weights + n * per_block
        free -= weights + n * per_block
    reserve = memory.activation_reserve_bytes(cfg.model, cfg.scheduler, torch.bfloat16)
    reserve += memory.runner_reserve_bytes(big)  # its CUDA-graph tables
    assert used + 2 * reserve <= 0.8 * total
    assert used + 2 * reserve > 0.8 * total - 2 * per_block  # and use all of it


def test_weight_bytes_come_from_the_headers_in_the_target_dtype(tiny_model):
    from engine.loader import load_weights

    tensors = load_weights(tiny_model)
    n = sum(t.numel() for t in tensors.values())
    assert memory.weight_bytes(tiny_model, torch.bfloat16) == 2 * n
    assert memory.weight_bytes(tiny_model, torch.float32) == 4 * n


def test_cpu_devices_use_kv_cache_memory_bytes(tiny_model):
    cfg = cfg_for(tiny_model, device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20)
    per_block = KVCache.bytes_per_block(cfg.model, 16, torch.float32)
    assert memory.num_kv_blocks(cfg) == (1 << 20) // per_block
    assert memory.num_kv_blocks(replace(cfg, cache=replace(cfg.cache, num_blocks=7))) == 7


def test_the_cap_is_what_max_num_seqs_sequences_could_use(tiny_model):
    cfg = cfg_for(tiny_model)
    n = memory.num_kv_blocks(cfg, memory=(140 * GiB, 141 * GiB, GiB))
    assert n == 4096 // 16 * 64


def test_no_room_for_a_single_block_is_a_clear_error(tiny_model):
    cfg = cfg_for(tiny_model)
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*"
                                         "gpu_memory_utilization=0.9"):
        memory.num_kv_blocks(cfg, memory=(100 << 20, 141 * GiB, 0))
    with pytest.raises(ValueError, match="needs the device's memory"):
        memory.num_kv_blocks(cfg)


def stub_cuda(monkeypatch, free: int, total: int, held: int = 0) -> list[str]:
    """Pretend this process sees one CUDA device with the given memory."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (calls.append("mem_get_info"), (free, total))[1])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: held)
    return calls


def test_a_worker_on_a_gpu_sizes_its_share_from_mem_get_info(tiny_model, monkeypatch):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import load_model_config
    from runtime.spec import resolve_engine

    calls = stub_cuda(monkeypatch, free=60 * GiB, total=80 * GiB)
    asked = EngineConfig(str(tiny_model), load_model_config(tiny_model),
                         CacheConfig(16, None, 1 << 30, False, gpu_memory_utilization=0.5,
                                     gpu_share=0.5),
                         SchedulerConfig(max_model_len=1 << 22), device="cuda:1",
                         dtype="bfloat16")
    cfg, n = resolve_engine(asked, ray_gpu_ids=["1"])
    assert cfg.device == "cuda:0" and calls == ["mem_get_info"]  # Ray's GPU, seen as cuda:0
    weights = memory.weight_bytes(tiny_model, torch.bfloat16)
    reserve = memory.activation_reserve_bytes(cfg.model, cfg.scheduler, torch.bfloat16)
    reserve += memory.runner_reserve_bytes(cfg)  # its CUDA-graph tables
    per_block = KVCache.bytes_per_block(cfg.model, 16, torch.bfloat16)
    assert n == (int(80 * GiB * 0.5 * 0.5) - weights - reserve) // per_block
    # an explicit num_blocks is kept, and no device is asked
    calls.clear()
    nine = replace(asked, cache=replace(asked.cache, num_blocks=9))
    assert resolve_engine(nine, ["1"])[1] == 9 and calls == []


def test_the_runner_sizes_its_cache_after_loading_the_weights(tiny_model, monkeypatch):
    """`ModelRunner(cfg, None)` loads the weights first, then sizes the cache (on a GPU
    from `device_memory`: the memory the loaded weights leave)."""
    from engine import model_runner

    events: list[str] = []
    real_load, real_size = model_runner.load_model, model_runner.num_kv_blocks
    monkeypatch.setattr(model_runner, "load_model",
                        lambda *a, **kw: (events.append("load"), real_load(*a, **kw))[1])
    monkeypatch.setattr(model_runner, "num_kv_blocks", lambda cfg, memory=None: (
        events.append(f"size memory={memory}"), real_size(cfg, memory=memory))[1])
    cfg = cfg_for(tiny_model, device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20)
    runner = model_runner.ModelRunner(cfg, None)
    assert events == ["load", "size memory=None"]
    assert runner.num_blocks == memory.num_kv_blocks(cfg) == runner.kv.num_blocks


def test_device_memory_reads_mem_get_info_and_the_allocator(monkeypatch):
    stub_cuda(monkeypatch, free=7 * GiB, total=80 * GiB, held=3 * GiB)
    assert memory.device_memory(torch.device("cuda", 0)) == (7 * GiB, 80 * GiB, 3 * GiB)


def test_credit_window_is_raised_to_two_chunks_of_the_model():
    from engine.config import ModelConfig

    eight_b = ModelConfig("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5,
                          8192, False, False, False, False, False)
    cfg = ServeConfig.from_dict({"model": {"dtype": "bfloat16"},
                                 "scheduler": {"max_prefill_chunk": 1000,
                                               "max_num_batched_tokens": 2048}})
    per_chunk = 1000 * 32 * 2 * 8 * 128 * 2  # 125 MiB
    assert per_chunk == 125 * (1 << 20)
    assert credit_window_bytes(cfg, eight_b) == 2 * per_chunk
    off = cfg.with_values({"transfer.credit_window_chunks": 0})
    assert credit_window_bytes(off, eight_b) == 64 << 20
    big = cfg.with_values({"transfer.credit_window_mb": 1024})
    assert credit_window_bytes(big, eight_b) == 1024 << 20


def test_planned_blocks_that_no_longer_fit_are_a_clear_error(tiny_model):
    cfg = cfg_for(tiny_model)
    per_block = KVCache.bytes_per_block(cfg.model, 16, torch.bfloat16)
    memory.check_kv_fits(cfg, 1000, free=1000 * per_block + memory.MIN_RESERVE_BYTES)
    with pytest.raises(ValueError, match="a KV cache of 1001 blocks needs .* GiB on cuda:0 but"):
        memory.check_kv_fits(cfg, 1001, free=1000 * per_block + memory.MIN_RESERVE_BYTES)
