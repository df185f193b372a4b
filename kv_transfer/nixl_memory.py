"""What the nixl connector keeps in registered memory, and the NIXL agent it registers with.

* ``Extents``: the sender's map of one receiver link's staging region: which byte ranges
  are free to write. A range is taken for one frame and given back only when that
  frame's ack came back, and the receiver acks a frame only after its write's
  notification arrived, that is after the write completed (NIXL cannot cancel a write in
  flight: ai-dynamo/nixl #2067). So an aborted request's ranges are never written twice
  while a write into them may still land; a dead link's region is dropped whole.
* ``SourceRegistrations``: the sender's registrations of the host tensors it writes
  from (a chunk's payload: one contiguous export buffer, so one descriptor per frame),
  by storage, kept alive while a write reads them and for a few more writes after.
* ``new_agent``: one agent per sender or receiver, UCX backend, no progress thread
  (the link threads and the receiver's notification poller drive progress).

The staging region is a plain CPU tensor here; on a CUDA decode worker it would be a
VRAM tensor (same code: NIXL takes either), see docs/design-nixl.md.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

ALIGN = 4096  # staging offsets: page aligned (any dtype's view of a slot is aligned)
UCX_ERROR_MODES = ("none", "peer")
_names = itertools.count(1)


def nixl_api() -> Any:
    """The nixl package's API module (``nixl-cu12`` wheel), or a clear error."""
    try:
        import nixl_cu12 as api
    except ImportError:
        try:
            import nixl as api  # type: ignore[no-redef]  # the CUDA-agnostic meta package
        except ImportError:
            raise RuntimeError("connector 'nixl' needs the nixl package: "
                               "pip install nixl-cu12 (make setup installs it)") from None
    return api


def new_agent(prefix: str, ucx_error_handling: str) -> Any:
    """A NIXL agent with the UCX backend. ``ucx_error_handling`` "none" lets UCX use its
    shared-memory transports (they cannot report a dead peer; pdserve's heartbeats and
    transfer leases do), "peer" restricts it to transports that can (tcp, rdma)."""
    if ucx_error_handling not in UCX_ERROR_MODES:
        raise ValueError(f"ucx_error_handling must be one of {UCX_ERROR_MODES}, "
                         f"got {ucx_error_handling!r}")
    api = nixl_api()
    import logging

    logging.getLogger("nixl").setLevel(logging.WARNING)  # one INFO line per agent otherwise
    name = f"{prefix}-{int(time.time() * 1e6):x}-{next(_names)}"
    conf = api.nixl_agent_config(
        enable_prog_thread=False, backends=[],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)  # many threads call it
    agent = api.nixl_agent(name, conf)
    agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_handling})
    return agent


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Extents:
    """First-fit allocator over ``[0, size)`` with coalescing frees; thread-safe, and
    ``take`` waits (bounded) for room. Offsets and lengths are ``ALIGN``-ed."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._lens: list[int] = [size]
        self._cond = threading.Condition()
        self._closed = False
        self.used = 0

    def try_take(self, nbytes: int) -> int | None:
        n = align_up(max(nbytes, 1))
        with self._cond:
            return self._take_locked(n)

    def take(self, nbytes: int, timeout_s: float) -> int:
        """An offset of ``nbytes`` free bytes; raises ``TimeoutError`` when none became
        free within ``timeout_s`` (the receiver stopped releasing), ``ValueError`` when
        the request can never fit, ``ConnectionAbortedError`` once closed."""
        n = align_up(max(nbytes, 1))
        if n > self.size:
            raise ValueError(f"a {nbytes}-byte frame cannot fit a {self.size}-byte staging region")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise ConnectionAbortedError("link closed")
                off = self._take_locked(n)
                if off is not None:
                    return off
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {nbytes}-byte staging slot freed within {timeout_s:g}s")
                self._cond.wait(left)

    def _take_locked(self, n: int) -> int | None:
        for i, ln in enumerate(self._lens):
            if ln >= n:
                off = self._starts[i]
                if ln == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                self.used += n
                return off
        return None

    def free(self, off: int, nbytes: int) -> None:
        n = align_up(max(nbytes, 1))
        with self._cond:
            i = bisect.bisect_left(self._starts, off)
            assert i == len(self._starts) or off + n <= self._starts[i], "double free"
            assert i == 0 or self._starts[i - 1] + self._lens[i - 1] <= off, "double free"
            self._starts.insert(i, off)
            self._lens.insert(i, n)
            if i + 1 < len(self._starts) and off + n == self._starts[i + 1]:  # merge right
                self._lens[i] += self._lens.pop(i + 1)
                self._starts.pop(i + 1)
            if i > 0 and self._starts[i - 1] + self._lens[i - 1] == off:  # merge left
                self._lens[i - 1] += self._lens.pop(i)
                self._starts.pop(i)
            self.used -= n
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        with self._cond:
            return list(zip(self._starts, self._lens, strict=True))


class SourceRegistrations:
    """Registered source memory by storage: ``acquire(t)`` registers ``t``'s whole storage
    once (UCX memory handles are per registration; a chunk's payload is a view of one
    export buffer), ``release`` after the write; idle registrations stay (an LRU of at
    most ``keep_bytes``, holding their storage) so a reused buffer registers once."""

    def __init__(self, agent: Any, keep_bytes: int) -> None:
        self._agent = agent
        self._keep = keep_bytes
        self._lock = threading.Lock()
        # storage ptr -> [storage, reg descs, users, nbytes]
        self._regs: OrderedDict[int, list] = OrderedDict()
        self.registered = 0  # registrations made (a reuse makes none)

    def acquire(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        with self._lock:
            e = self._regs.get(ptr)  # held alive by the entry: ptr cannot be another's
            if e is None:
                descs = self._agent.register_memory([(ptr, n, 0, "")], "DRAM")
                e = self._regs[ptr] = [st, descs, 0, n]
                self.registered += 1
            e[2] += 1
            self._regs.move_to_end(ptr)
            return ptr

    def release(self, ptr: int) -> None:
        with self._lock:
            e = self._regs.get(ptr)
            if e is None:
                return
            e[2] -= 1
            idle = [(p, x) for p, x in self._regs.items() if x[2] == 0]
            kept = sum(x[3] for _, x in idle)
            for p, x in idle:  # oldest first
                if kept <= self._keep:
                    break
                kept -= x[3]
                self._drop_locked(p)

    def _drop_locked(self, ptr: int) -> None:
        e = self._regs.pop(ptr)
        try:
            self._agent.deregister_memory(e[1])
        except Exception:  # the agent may be gone with its process's teardown
            pass

    def close(self) -> None:
        with self._lock:
            for p in list(self._regs):
                self._drop_locked(p)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"source_registrations": len(self._regs),
                    "source_registered_bytes": sum(x[3] for x in self._regs.values()),
                    "source_registrations_made": self.registered,
                    "source_in_use": sum(1 for x in self._regs.values() if x[2])}
