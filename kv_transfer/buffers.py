"""Receive-buffer pool: big payload buffers are reused instead of freshly allocated.

Why: a fresh multi-MiB tensor is fresh memory from the OS (mmap), so every frame pays a
page fault and a kernel zeroing pass per 4 KiB before a single byte is received; at
loopback speeds that costs as much as the copy itself.

Safety without trusting the owner: the pool keeps every buffer it lent and reuses one
only once *no one else* references its memory, judged by the storage's use count (every
tensor, view or ``.numpy()`` array of it holds one). A chunk the owner still holds,
released or not, is never overwritten. If the torch build lacks the use-count hook the
pool just allocates fresh buffers.

Pinned: in a process that drives a GPU (one whose CUDA context exists: a decode worker's
engine), big buffers are page-locked, so the KV import copies a received chunk to the
device straight from it, with no pageable-to-pinned staging copy on the engine's thread
(engine/kv_cache.py). Until then, and in processes that never touch CUDA, they are plain.
"""

from __future__ import annotations

import threading

import torch

from engine.device import pinned_empty

_use_count = getattr(torch._C, "_storage_Use_Count", None)
MIN_POOLED_BYTES = 1 << 20  # smaller buffers come from malloc's heap cheaply anyway


def _refs(buf: torch.Tensor) -> int:
    assert _use_count is not None
    return _use_count(buf.untyped_storage()._cdata)


def size_class(nbytes: int) -> int:
    """Round up to 1/8 of the enclosing power of two (<= 12.5% waste), >= 1 MiB."""
    step = max(MIN_POOLED_BYTES, (1 << (nbytes.bit_length() - 1)) // 8)
    return -(-nbytes // step) * step


def _cuda_process() -> bool:
    return torch.cuda.is_initialized()


class BufferPool:
    def __init__(self, max_idle_bytes: int, pin: bool | None = None) -> None:
        """`pin`: page-locked buffers; None: once this process has a CUDA context."""
        self._max_idle = max_idle_bytes
        self._pin = pin
        self._pinned: set[int] = set()  # ids of the lent buffers allocated to be pinned
        self._lock = threading.Lock()
        self._lent: list[torch.Tensor] = []  # every buffer handed out, base tensors
        self._baseline: int | None = None  # use count of a buffer nobody else holds
        self.enabled = _use_count is not None
        self.reused = 0
        self.allocated = 0

    def get(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of exactly ``nbytes`` (contents undefined)."""
        if not self.enabled or nbytes < MIN_POOLED_BYTES:
            return torch.empty(nbytes, dtype=torch.uint8)
        want = size_class(nbytes)
        pin = _cuda_process() if self._pin is None else self._pin
        with self._lock:
            idle = [b for b in self._lent if _refs(b) == self._baseline]
            pick = next((b for b in idle if b.numel() == want
                         and (id(b) in self._pinned) == pin), None)
            # cap the memory parked here: forget idle buffers beyond the budget
            parked = sum(b.numel() for b in idle if b is not pick)
            drop: set[int] = set()
            for b in idle:
                if b is not pick and parked > self._max_idle:
                    drop.add(id(b))
                    parked -= b.numel()
            if drop:  # by identity: == on tensors compares elements
                self._lent = [b for b in self._lent if id(b) not in drop]
                self._pinned -= drop
            if pick is None:
                pick = pinned_empty((want,), torch.uint8) if pin else torch.empty(
                    want, dtype=torch.uint8)
                if pin:  # (pageable after all where the OS refuses: pinned_empty says so)
                    self._pinned.add(id(pick))
                if self._baseline is None:
                    self._baseline = _refs(pick)
                self._lent.append(pick)
                self.allocated += 1
            else:
                self.reused += 1
            return pick[:nbytes]

    @property
    def lent_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._lent)
