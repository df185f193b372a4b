"""Decode admission: requests waiting for a decode reservation, served in arrival order.

`DecodeAdmission.admit` queues a leg in an `AdmissionQueue` and returns the decode worker
that reserved room for it (its prompt + headroom as a promise, least KV usage first).

Only the head of the queue asks the decode workers for room, so a later arrival never
overtakes an earlier waiter: capacity that frees up goes to the oldest request first,
and a large request cannot starve behind a stream of small ones. Re-dispatched legs
(preemption, failure) keep their request's original arrival time and so go ahead of
newer requests. A waiter leaves when it is admitted, when its request ends (abort,
deadline, drain: `wake(flight)`), or when it gives up; each departure of the head wakes
the next one, and `wake_head()` is called whenever decode capacity may have freed.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.flight import Flight, RouterCore
from cluster.pool import WorkerHandle
from cluster.types import ErrorCode, RouterError
from runtime.messages import DecodeTask

log = logging.getLogger(__name__)
RETRY_S = 0.25  # the head re-asks even when no event said "freed" (e.g. a KV-wait expiry)


@dataclass(eq=False)
class Waiter:
    key: tuple[float, int]  # (arrival, tie-break): the queue's order
    flight: Any
    event: asyncio.Event = field(default_factory=asyncio.Event)


class AdmissionQueue:
    def __init__(self) -> None:
        self._waiters: list[Waiter] = []  # sorted by key
        self._of: dict[int, list[Waiter]] = {}  # id(flight) -> its waiters (a new leg's
        self._seq = itertools.count()  # may queue while its old one is leaving)

    def __len__(self) -> int:
        return len(self._waiters)

    def enqueue(self, flight: Any, arrival: float) -> Waiter:
        w = Waiter((arrival, next(self._seq)), flight)
        bisect.insort(self._waiters, w, key=lambda x: x.key)
        self._of.setdefault(id(flight), []).append(w)
        if self._waiters[0] is w:
            w.event.set()  # a new head: try at once
        return w

    def is_head(self, w: Waiter) -> bool:
        return bool(self._waiters) and self._waiters[0] is w

    def remove(self, w: Waiter) -> None:
        was_head = self.is_head(w)
        i = bisect.bisect_left(self._waiters, w.key, key=lambda x: x.key)
        if i < len(self._waiters) and self._waiters[i] is w:
            del self._waiters[i]
        mine = self._of.get(id(w.flight), [])
        if w in mine:
            mine.remove(w)
            if not mine:
                del self._of[id(w.flight)]
        if was_head:
            self.wake_head()

    def wake_head(self) -> None:
        if self._waiters:
            self._waiters[0].event.set()

    def wake(self, flight: Any) -> None:
        """Wake `flight`'s waiter (its request ended: it must leave the queue); every
        request that ends calls this, so it looks the waiter up instead of scanning."""
        for w in self._of.get(id(flight), ()):
            w.event.set()


class DecodeAdmission:
    """The router's decode admission: the queue plus the reserve calls of its head."""

    def __init__(self, router: RouterCore):
        self.router = router
        self.queue = AdmissionQueue()

    def __len__(self) -> int:
        return len(self.queue)

    def wake_head(self) -> None:
        self.queue.wake_head()

    def wake(self, flight: Flight) -> None:
        self.queue.wake(flight)

    def check_fits(self, prompt_len: int) -> None:
        """A prompt no decode worker's whole KV cache can hold is refused at once."""
        # (WorkerHandle.capacity_tokens, read per request: a 0 block_size is "unknown")
        caps = [w.num_blocks * w.block_size if w.block_size else None
                for w in self.router.decode if w.role == "decode"]
        if caps and None not in caps and prompt_len + 1 > max(caps):
            raise RouterError(ErrorCode.RESOURCE_EXHAUSTED,
                              f"prompt of {prompt_len} tokens cannot fit any decode worker's "
                              f"KV cache ({max(caps)} tokens)")

    async def admit(self, flight: Flight, task: DecodeTask) -> WorkerHandle | None:
        """Wait in the admission queue until a decode worker reserves room for the leg;
        None when the request ended meanwhile (abort, deadline, drain)."""
        start = time.monotonic()
        grace_end = start + self.router.config.unavailable_grace_s
        limit = self.router.config.admission_timeout_s
        waiter = self.queue.enqueue(flight, flight.arrival)
        try:
            while True:
                waiter.event.clear()  # before the checks: a wake-up from here on is kept
                if flight.done or flight.leg_id != task.leg_id:
                    return None
                if self.queue.is_head(waiter):
                    w = await self._reserve(flight, task, grace_end)
                    if w is not None:
                        return w
                if limit is not None and time.monotonic() > start + limit:
                    raise RouterError(ErrorCode.RESOURCE_EXHAUSTED,
                                      "no decode worker could admit the request in time "
                                      f"(admission_timeout_s={limit:g})")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.event.wait(), RETRY_S)
        finally:
            self.queue.remove(waiter)

    async def _reserve(self, flight: Flight, task: DecodeTask,
                       grace_end: float) -> WorkerHandle | None:
        """One round over the live decode workers (least KV usage first)."""
        alive = [w for w in self.router.decode if w.alive]
        if len(alive) > 1:
            alive.sort(key=lambda w: w.kv_usage)
        if not alive or not any(w.alive for w in self.router.prefill):
            if time.monotonic() > grace_end:  # no restart came back in time
                pool = "decode" if not alive else "prefill"
                raise RouterError(ErrorCode.UNAVAILABLE, f"no {pool} worker is alive")
            return None
        for w in alive:
            try:
                ok = await w.actor.reserve.remote(task)
            except asyncio.CancelledError:  # the client left mid-reserve
                self.router.abort_on(w, task.leg_id)
                raise
            except ValueError as e:  # can never fit: say so now, not after a wait
                raise RouterError(ErrorCode.RESOURCE_EXHAUSTED, str(e)) from e
            except Exception as e:  # dead worker: skip it (a reserve that landed is undone)
                log.warning("decode %s failed on reserve: %s", w.worker_id, e)
                self.router.abort_on(w, task.leg_id)
                self.router.mark_dead(w)
                continue
            if not ok:
                continue
            if flight.done or flight.leg_id != task.leg_id:
                self.router.abort_on(w, task.leg_id)  # ended while the reserve was in flight
                return None
            flight.admitted = True
            return w
        return None
