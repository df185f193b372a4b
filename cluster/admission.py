"""Decode admission: requests waiting for a decode reservation, served in arrival order.

`DecodeAdmission.admit` queues a leg in an `AdmissionQueue` and returns the decode worker
that reserved room for it (its prompt + headroom as a promise, least KV usage first).

Several waiters ask at once, each a different decode worker (one `reserve` in flight per
worker), so admissions are not serialised behind one waiter's round trips. Arrival order
is kept by two rules. (1) A waiter's grant on worker W is *tentative* until every earlier
waiter still queued has been refused by W in the current round; only then is it kept
(the head's grants are kept at once). Before an earlier waiter asks W, the tentative
grants of later waiters on W are given back, so the refusal it gets was not caused by
them. (2) A waiter refused by every worker is *blocked*: nothing behind it asks or keeps
a grant until it is admitted or leaves (as when only the head asked), so a large request
cannot starve behind a stream of small ones. Together: a later waiter keeps only room
that each earlier waiter was refused on and while each still had another worker to try.
Every event that may free decode capacity (`wake_head`), and the head's retry after
RETRY_S, starts a new round: refusals from before it no longer count, and a refusal
whose answer crossed a new round is not counted at all. (A capacity freed on W that the
router has not heard of yet may go to a later waiter that asks W before it hears.)
Re-dispatched legs (preemption, failure) keep their request's original arrival time and
so go ahead of newer requests. A waiter leaves when it is admitted, when its request
ends (abort, deadline, drain: `wake(flight)`), or when it gives up; a reservation that
reaches a waiter that already left is released.
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
    task: DecodeTask | None = None
    asking: WorkerHandle | None = None  # its reserve in flight
    held: WorkerHandle | None = None  # a tentative grant (an earlier waiter may need it)
    granted: WorkerHandle | None = None  # a kept grant: it leaves with it
    error: RouterError | None = None
    tried: set[int] = field(default_factory=set)  # id()s of workers that refused it ...
    round: int = -1  # ... in this round of the admission
    blocked: bool = False  # once refused by every worker: nothing behind it goes first
    left: bool = False


class AdmissionQueue:
    def __init__(self) -> None:
        self.waiters: list[Waiter] = []  # sorted by key
        self._of: dict[int, list[Waiter]] = {}  # id(flight) -> its waiters (a new leg's
        self._seq = itertools.count()  # may queue while its old one is leaving)

    def __len__(self) -> int:
        return len(self.waiters)

    def enqueue(self, flight: Any, arrival: float) -> Waiter:
        w = Waiter((arrival, next(self._seq)), flight)
        bisect.insort(self.waiters, w, key=lambda x: x.key)
        self._of.setdefault(id(flight), []).append(w)
        return w

    def is_head(self, w: Waiter) -> bool:
        return bool(self.waiters) and self.waiters[0] is w

    def remove(self, w: Waiter) -> None:
        i = bisect.bisect_left(self.waiters, w.key, key=lambda x: x.key)
        if i < len(self.waiters) and self.waiters[i] is w:
            del self.waiters[i]
        mine = self._of.get(id(w.flight), [])
        if w in mine:
            mine.remove(w)
            if not mine:
                del self._of[id(w.flight)]

    def wake(self, flight: Any) -> None:
        """Wake `flight`'s waiter (its request ended: it must leave the queue); every
        request that ends calls this, so it looks the waiter up instead of scanning."""
        for w in self._of.get(id(flight), ()):
            w.event.set()


class DecodeAdmission:
    """The router's decode admission: the queue and the reserve calls of its waiters."""

    def __init__(self, router: RouterCore):
        self.router = router
        self.queue = AdmissionQueue()
        self.round = 0
        self.busy: dict[int, Waiter] = {}  # id(worker) -> the waiter whose call is on it

    def __len__(self) -> int:
        return len(self.queue)

    def wake_head(self) -> None:
        """Decode capacity may have freed: a new round (earlier refusals are stale)."""
        self.round += 1
        self._pump()

    def wake(self, flight: Flight) -> None:
        self.queue.wake(flight)

    def check_fits(self, prompt_len: int) -> None:
        """A prompt no decode worker's whole KV cache can hold is refused at once."""
        caps = [w.capacity_tokens for w in self.router.decode if w.role == "decode"]
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
        waiter.task = task
        try:
            self._pump()
            while True:
                waiter.event.clear()  # before the checks: a wake-up from here on is kept
                if flight.done or flight.leg_id != task.leg_id:
                    return None
                if waiter.error is not None:
                    raise waiter.error
                if waiter.granted is not None:
                    w, waiter.granted = waiter.granted, None
                    flight.admitted = True
                    return w
                self._check_pools(grace_end)
                if limit is not None and time.monotonic() > start + limit:
                    raise RouterError(ErrorCode.RESOURCE_EXHAUSTED,
                                      "no decode worker could admit the request in time "
                                      f"(admission_timeout_s={limit:g})")
                try:
                    await asyncio.wait_for(waiter.event.wait(), RETRY_S)
                except TimeoutError:  # a head between its tries re-asks on its own
                    if (self.queue.is_head(waiter) and waiter.asking is None
                            and waiter.held is None):
                        self.wake_head()
        finally:
            waiter.left = True
            for w in (waiter.held, waiter.granted):
                if w is not None:  # a reservation it no longer uses
                    self.router.abort_on(w, task.leg_id)
            waiter.held = waiter.granted = None
            self.queue.remove(waiter)
            self._pump()  # later waiters may keep their grants now, or ask its worker

    def _check_pools(self, grace_end: float) -> None:
        decode_up = any(w.alive for w in self.router.decode)
        if (not decode_up or not any(w.alive for w in self.router.prefill)) \
                and time.monotonic() > grace_end:  # no restart came back in time
            pool = "decode" if not decode_up else "prefill"
            raise RouterError(ErrorCode.UNAVAILABLE, f"no {pool} worker is alive")

    def _tried(self, w: Waiter) -> set[int]:
        if w.round != self.round:
            w.tried, w.round = set(), self.round
        return w.tried

    # ---- the waiters' reserve calls -------------------------------------------------
    def _pump(self) -> None:
        """Walk the queue in order: keep the tentative grants that no earlier waiter can
        use any more, and start a reserve for each idle waiter on a free worker."""
        alive = sorted((w for w in self.router.decode if w.alive), key=lambda w: w.kv_usage)
        free = set()
        if alive and any(w.alive for w in self.router.prefill):
            free = {id(w) for w in alive if id(w) not in self.busy}
        passed: set[int] | None = None  # workers that refused every earlier waiter
        for wt in list(self.queue.waiters):
            if (wt.left or wt.granted is not None or wt.error is not None or wt.flight.done
                    or wt.task is None or wt.flight.leg_id != wt.task.leg_id):
                continue  # (an ended request's or leg's waiter is leaving: it asks no more)
            if wt.held is not None and not wt.held.alive:  # died under its tentative grant:
                self.router.abort_on(wt.held, wt.task.leg_id)  # undone (if it lives);
                wt.held = None  # it asks again
            if wt.held is not None and (passed is None or id(wt.held) in passed):
                wt.granted, wt.held = wt.held, None
                wt.event.set()
                continue
            tried = self._tried(wt)
            if free and wt.asking is None and wt.held is None:
                self._start(wt, alive, free, tried)
            if (alive and wt.asking is None and wt.held is None
                    and all(id(w) in tried for w in alive)):
                wt.blocked = True  # refused everywhere: from now on it waits for room
            if wt.blocked:
                break  # nothing behind it asks or keeps a grant (it may need any room)
            passed = set(tried) if passed is None else passed & tried
            if not passed and not free:
                break  # no later waiter may keep a grant or ask anyone now

    def _start(self, wt: Waiter, alive: list[WorkerHandle], free: set[int],
               tried: set[int]) -> None:
        """Ask the first free worker that has not refused `wt` this round, preferring
        one where no later waiter holds a tentative grant (that would be given back)."""
        ok = [w for w in alive if id(w) in free and id(w) not in tried]
        if not ok:
            return
        later = {id(v.held): [] for v in self.queue.waiters if v.held is not None}
        for v in self.queue.waiters:
            if v.held is not None and v.key > wt.key:
                later[id(v.held)].append(v)
        w = next((w for w in ok if not later.get(id(w))), ok[0])
        revoke = later.get(id(w), [])
        for v in revoke:
            v.held = None
        free.discard(id(w))
        self.busy[id(w)] = wt
        wt.asking = w
        self.router.spawn(self._ask(wt, w, revoke))

    async def _ask(self, wt: Waiter, w: WorkerHandle, revoke: list[Waiter]) -> None:
        assert wt.task is not None  # set by admit() before its first _pump
        leg, flight, round_ = wt.task.leg_id, wt.flight, self.round
        ok = False
        try:
            for v in revoke:  # give later waiters' room back first, and wait until it is
                assert v.task is not None
                with contextlib.suppress(Exception):
                    await w.actor.abort.remote(v.task.leg_id)
                v.event.set()
            try:
                ok = await w.actor.reserve.remote(wt.task)
            except asyncio.CancelledError:  # shut down mid-reserve
                self.router.abort_on(w, leg)
                raise
            except ValueError as e:  # can never fit: say so now, not after a wait
                wt.error = RouterError(ErrorCode.RESOURCE_EXHAUSTED, str(e))
            except Exception as e:  # dead worker: skip it (a reserve that landed is undone)
                log.warning("decode %s failed on reserve: %s", w.worker_id, e)
                self.router.abort_on(w, leg)
                self.router.mark_dead(w)
            if ok and (wt.left or flight.done or flight.leg_id != leg):
                self.router.abort_on(w, leg)  # ended while the reserve was in flight
            elif ok:
                wt.held = w
            elif round_ == self.round:  # a refusal from an older round proves nothing
                self._tried(wt).add(id(w))
        finally:
            wt.asking = None
            if self.busy.get(id(w)) is wt:
                del self.busy[id(w)]
            wt.event.set()
            self._pump()
