"""KVIntake: the host's part of a decode worker's KV import, off its loop thread.

With the host one step ahead (``scheduler.overlap``; docs/design.md §3 "Overlap", §4
step 5) the loop thread only decides where an arrived range goes (the blocks it needs,
allocated within the leg's promise) and hands it here; the bytes' work -- on the emulated
device the check of every range against the KV pattern and the copy into the cache, on
a CPU cache the copy -- runs on this thread, as a GPU's copy stream runs an import while
its host goes on, and its torch ops leave the GIL to the loop meanwhile. The device's
part of the import (the emulated device's copy time on its queue) is charged on the
loop thread at hand-off, as before.

Safe because the blocks written belong to a leg that is still pending -- no step reads
them -- and because no range is taken in before it is written: the engine takes the
ones done (``harvest``, waiting for none) at the start and the end of each ``step()``
call, and a leg starts only once none of its ranges is still being written
(``Pending.in_intake``); before a leg's blocks are freed (an abort, a failure, an
expiry, a failed step) its ranges are joined (``join``). So a range may still be on the
thread between two ``step()`` calls, as a GPU's copy stream may still be importing
between steps: the loop never waits for a copy no leg needs yet (joining every range at
the end of the call that handed it over made each decode step that took a long prompt's
KV in wait for its copy: 10-15 ms steps instead of 4 on the emulated H200).

A CUDA cache's import is asynchronous already (its side stream) and a tensor-parallel
group's is a collective: those stay inline (``for_cache`` returns None).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.kv_cache import KVCache
from kv_transfer.base import KVChunk


@dataclass(slots=True)
class Landed:
    """A range handed over and done: ``problem`` is why it could not be written."""

    chunk: KVChunk
    pending: Any  # the leg's decode_worker.scheduler.Pending when it was handed over
    problem: str | None


_pool: ThreadPoolExecutor | None = None  # one intake thread per process, shared
_pool_lock = threading.Lock()


def _thread() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="kv-intake")
        return _pool


class KVIntake:
    def __init__(self, host: Callable[..., None], device: Callable[..., None] | None = None):
        """``host(block_ids, start, data, layer_start=, head_start=)``: the bytes' work,
        on the intake thread; ``device(block_ids, start, num_tokens)``: the device's part, on the caller's.
        The thread is the process's one (an engine holds no thread of its own: several
        engines of a process, as in tests, share it; each joins only its own ranges)."""
        self._host, self._device = host, device
        self._jobs: list[tuple[Future, KVChunk, Any]] = []
        self.ranges = 0  # ranges handed over (stats)

    @staticmethod
    def for_cache(kv: Any) -> KVIntake | None:
        """An intake for ``kv`` if its import may leave the loop thread: the emulated
        device's (``copy_in``, ``charge_import``) or a CPU ``KVCache``; else None."""
        copy_in = getattr(kv, "copy_in", None)
        if copy_in is not None:
            return KVIntake(copy_in, kv.charge_import)
        if type(kv) is KVCache and kv.device.type == "cpu":
            return KVIntake(kv.import_tokens)
        return None

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def put(self, chunk: KVChunk, block_ids: Sequence[int], pending: Any) -> None:
        """Hand one range over (the loop thread): its device part is charged now."""
        if self._device is not None:
            self._device(block_ids, chunk.token_start, chunk.num_tokens)
        self.ranges += 1
        fut = _thread().submit(self._host, tuple(block_ids), chunk.token_start, chunk.payload,
                               layer_start=chunk.layer_start, head_start=chunk.head_start)
        self._jobs.append((fut, chunk, pending))

    def harvest(self) -> list[Landed]:
        """The ranges in place (or failed) by now, waiting for none: those handed over
        before the first one still being written, in the order handed over."""
        n = 0
        for fut, _, _ in self._jobs:
            if not fut.done():
                break
            n += 1
        return self._take(n)

    def join(self, leg_id: str | None = None) -> list[Landed]:
        """Wait until every range handed over is in place (or failed) -- with ``leg_id``,
        every one up to that leg's last (the thread writes them in order) -- and return
        them, in the order handed over, forgetting them."""
        n = len(self._jobs)
        if leg_id is not None:
            while n and self._jobs[n - 1][1].request_id != leg_id:
                n -= 1
        return self._take(n)

    def _take(self, n: int) -> list[Landed]:
        jobs, self._jobs = self._jobs[:n], self._jobs[n:]
        out = []
        for fut, chunk, pending in jobs:
            e = fut.exception()  # (waits)
            problem = None if e is None else (
                f"KV chunk [{chunk.token_start}, {chunk.token_end}) could not be "
                f"written: {type(e).__name__}: {e}")  # (the inline path's words)
            out.append(Landed(chunk, pending, problem))
        return out
