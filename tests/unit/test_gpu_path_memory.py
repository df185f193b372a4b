"""Issue 37, item 8: KV sizing on a GPU reads the memory after the caching allocator has
handed back what no tensor uses. `fuse()` replaces q/k/v and gate/up by fused copies; the
originals stay reserved by the allocator, and counted as held they shrank the KV cache by
their size (a GPU's allocator, stubbed: reserved vs live bytes)."""

from __future__ import annotations

import torch

from engine import memory

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
