"""Receive-buffer pool and on-the-fly hashing: fast paths that must never corrupt data."""

from __future__ import annotations

import os

import pytest
import torch

from kv_transfer.buffers import MIN_POOLED_BYTES, BufferPool, size_class
from kv_transfer.wire import CHECKSUM_FUNCS, Hasher, checksum

MiB = 1 << 20


def test_size_classes_round_up_by_at_most_an_eighth():
    for n in (MiB, MiB + 1, 6 * MiB + 5, 48 * MiB, 100 * MiB + 3):
        c = size_class(n)
        assert n <= c <= max(n + MiB, int(n * 1.125) + 1)


@pytest.mark.skipif(not BufferPool(1).enabled, reason="torch lacks the storage use-count hook")
def test_pool_reuses_a_buffer_only_once_nobody_references_it():
    pool = BufferPool(max_idle_bytes=64 * MiB)
    a = pool.get(6 * MiB)
    payload = a.view(torch.float32).view(6, 2, -1)  # what the owner would hold
    del a
    b = pool.get(6 * MiB)  # payload is alive: must get different memory
    assert b.data_ptr() != payload.data_ptr()
    del b
    view = payload[1:2]  # views keep the memory referenced too
    del payload
    c = pool.get(6 * MiB)
    assert c.data_ptr() != view.data_ptr()
    arr = view.numpy()  # and so do numpy arrays of it
    del view
    d = pool.get(6 * MiB)
    assert d.data_ptr() not in (arr.ctypes.data,)
    del arr
    e = pool.get(6 * MiB)  # the first buffer is free at last
    assert pool.reused >= 1 and e.numel() == 6 * MiB
    small = pool.get(MIN_POOLED_BYTES - 1)
    assert small.numel() == MIN_POOLED_BYTES - 1  # small ones are not pooled


def test_pool_caps_the_memory_it_parks():
    pool = BufferPool(max_idle_bytes=8 * MiB)
    bufs = [pool.get(4 * MiB) for _ in range(6)]
    del bufs
    pool.get(4 * MiB)
    assert pool.lent_bytes <= 8 * MiB + 2 * size_class(4 * MiB)


@pytest.mark.parametrize("algo", sorted(CHECKSUM_FUNCS))
def test_incremental_hash_equals_one_shot_checksum(algo):
    data = os.urandom(3 * MiB + 17)
    h = Hasher(algo)
    mv = memoryview(data)
    for i in range(0, len(data), 100_003):
        h.update(mv[i : i + 100_003])
    assert h.digest() == checksum(algo, data)
