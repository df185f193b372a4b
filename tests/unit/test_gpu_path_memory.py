"""Issue 37, item 8: KV sizing on a GPU reads the memory after the caching allocator has
handed back what no tensor uses. `fuse()` replaces q/k/v and gate/up by fused copies; the
originals stay reserved by the allocator, and counted as held they shrank the KV cache by
their size (a GPU's allocator, stubbed: reserved vs live bytes)."""

from __future__ import annotations

import torch

from engine import memory
from engine.kv_cache import KVCache

GiB = 1 << 30


class _Allocator:
    """A caching allocator that holds 5 GiB of live weights and 2 GiB of freed copies."""

    def __init__(self):
        self.live, self.cached, self.free = 5 * GiB, 2 * GiB, 60 * GiB
        self.calls: list[str] = []

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.free += self.cached
        self.cached = 0

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.free, 80 * GiB

    def memory_reserved(self, device=None) -> int:
        return self.live + self.cached


def test_device_memory_counts_live_tensors_not_freed_copies(monkeypatch):
    a = _Allocator()
    for name in ("empty_cache", "mem_get_info", "memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, getattr(a, name))
    free, total, held = memory.device_memory(torch.device("cuda", 0))
    assert a.calls == ["empty_cache", "mem_get_info"]  # released before it is read
    assert (free, total, held) == (62 * GiB, 80 * GiB, 5 * GiB)


def test_the_graph_tables_are_inside_the_kv_reserve(tiny_model):
    """Issue 37 item 4: the CUDA-graph block tables `[largest bucket, max_model_len /
    block_size]` int32 are allocated after the cache is sized; the sizing reserves them
    (they were outside its budget: 268 MB for 64 rows of max_model_len 2^24)."""
    from dataclasses import replace

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import load_model_config

    cfg = EngineConfig(str(tiny_model), load_model_config(tiny_model), CacheConfig(16),
                       SchedulerConfig(max_model_len=1 << 24, max_num_seqs=64),
                       device="cuda:0", dtype="bfloat16")
    assert memory.runner_reserve_bytes(cfg) == 64 * (1 << 20) * 4  # auto: decode graphs
    for no_graphs in (replace(cfg, compile="none"), replace(cfg, compile="prefill"),
                      replace(cfg, device="cpu"),
                      replace(cfg, compile="auto", tensor_parallel_size=2)):
        assert memory.runner_reserve_bytes(no_graphs) == 0
    free = 60 * GiB
    with_tables = memory.num_kv_blocks(cfg, memory=(free, 80 * GiB, 0))
    without = memory.num_kv_blocks(replace(cfg, compile="none"), memory=(free, 80 * GiB, 0))
    per_block = KVCache.bytes_per_block(cfg.model, 16, torch.bfloat16)
    assert (without - with_tables) * per_block >= memory.runner_reserve_bytes(cfg)
