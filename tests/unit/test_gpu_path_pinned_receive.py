"""Issue 37, item 6: receive buffers are page-locked in a process that drives a GPU, so a
received KV chunk reaches the device from where it landed: the decode loop thread no
longer makes a blocking pageable-to-pinned copy of every chunk (~10-20 ms per 64 MiB chunk
of an 8B model). A CPU has no pinned memory; what it can show is which allocation the
pool asks for and that it still reuses buffers. The import's side is tests/gpu/
test_kv_cache_gpu.py (no staging copy, the buffer held until its copy is done)."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import buffers
from kv_transfer.buffers import BufferPool

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not BufferPool(1).enabled,
                                reason="torch lacks the storage use-count hook")


@pytest.fixture()
def pins(monkeypatch):
    asked: list[tuple[int, ...]] = []

    def pinned_empty(shape, dtype):
        asked.append(tuple(shape))
        return torch.empty(tuple(shape), dtype=dtype)  # (no pinned memory without CUDA)

    monkeypatch.setattr(buffers, "pinned_empty", pinned_empty)
    return asked


def test_a_gpu_process_receives_into_pinned_buffers_and_reuses_them(pins, monkeypatch):
    cuda = {"up": False}
    monkeypatch.setattr(buffers, "_cuda_process", lambda: cuda["up"])
    pool = BufferPool(max_idle_bytes=64 * MiB)  # pin=None: follows the process
    a = pool.get(6 * MiB)
    assert pins == []  # no CUDA context yet: a plain buffer
    del a
    cuda["up"] = True  # the engine has built its CUDA context
    b = pool.get(6 * MiB)
    assert pins == [(buffers.size_class(6 * MiB),)]  # not the idle pageable one
    ptr = b.data_ptr()
    del b
    c = pool.get(6 * MiB)
    assert c.data_ptr() == ptr and len(pins) == 1  # the pinned one, reused
    small = pool.get(MiB - 1)
    assert small.numel() == MiB - 1 and len(pins) == 1  # small ones stay unpooled


def test_explicit_pinning_and_its_absence(pins):
    pinned, plain = BufferPool(64 * MiB, pin=True), BufferPool(64 * MiB, pin=False)
    x, y = pinned.get(2 * MiB), plain.get(2 * MiB)
    assert len(pins) == 1 and x.numel() == y.numel() == 2 * MiB
    del x
    assert pinned.get(2 * MiB).numel() == 2 * MiB and pinned.reused == 1 and len(pins) == 1


def test_no_cuda_context_means_no_pinning_here():
    assert not torch.cuda.is_initialized()  # the CPU test process
    assert not buffers._cuda_process()
