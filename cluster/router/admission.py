"""Decode admission: requests waiting for a decode reservation, served in the queue's order
(arrival order, or the tenants' weighted shares: cluster/router/policies.py ADMISSION_ORDERS).

`AdmissionCore` decides, with no asyncio or Ray (the router and the simulator, sim/
admission.py, drive the same object): the queue of waiters, which one asks which decode
worker, which grants are kept. `DecodeAdmission` drives it with `admit` and real `reserve`
calls. Several waiters ask at once, one `reserve` in flight per worker, so admissions are
not serialised behind one waiter's round trips. The queue's order is kept by two rules. (1) A
waiter's grant on worker W is *tentative* until every earlier waiter still queued has
been refused by W in the current round; only then is it kept (the head's at once). Before
an earlier waiter asks W, the tentative grants of later waiters on W are given back, so
the refusal it gets was not caused by them. (2) A waiter refused by every worker is
*blocked*: nothing behind it asks or keeps a grant until it is admitted or leaves, so a
large request cannot starve behind a stream of small ones. Every event that may free
decode capacity (`wake_head`), and the head's retry after RETRY_S, starts a new round:
older refusals no longer count, nor does a refusal whose answer crossed a new round. (A
capacity freed on W that the router has not heard of yet may go to a later waiter that
asks W before it hears.) Re-dispatched legs keep their arrival time. A waiter leaves
when admitted, when its request ends (`wake(flight)`) or gives up (its late grant goes).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.router.flight import Flight, RouterCore
from cluster.router.policies import AdmissionOrder, ArrivalOrder, make_admission_order
from cluster.router.pool import WorkerHandle
from cluster.router.types import ErrorCode, RouterError
from runtime.messages import DecodeTask

log = logging.getLogger(__name__)
RETRY_S = 0.25  # the head re-asks even when no event said "freed" (e.g. a KV-wait expiry)
MAX_TENANTS = 64  # tenants counted apart in the admission's shares (the rest: "other")


@dataclass(eq=False)
class Waiter:
    key: tuple[float, ...]  # (the order's key..., tie-break): the queue's order
    flight: Any  # has .done and .leg_id (its current leg)
    task: Any  # what its driver asks with (a DecodeTask: .leg_id)
    event: Any = None  # its driver's wake-up state (the router's asyncio.Event)
    asking: Any = None  # the worker its reserve is in flight on
    held: Any = None  # a tentative grant (an earlier waiter may need it)
    granted: Any = None  # a kept grant: it leaves with it
    error: Any = None  # the reason it can never be admitted (its driver's error)
    tried: set[int] = field(default_factory=set)  # id()s of workers that refused it ...
    round: int = -1  # ... in this round of the admission
    blocked: bool = False  # once refused by every worker: nothing behind it goes first
    left: bool = False


class AdmissionDriver(Protocol):  # what an AdmissionCore asks of the router or the simulator
    def candidates(self) -> tuple[list, bool]:
        """The live decode workers in the order to ask them; may any be asked now?"""

    def ask(self, waiter: Waiter, worker: Any, revoke: list[Waiter]) -> None:
        """Give `revoke`'s grants on `worker` back, then reserve there; then `answered`."""

    def abort_on(self, worker: Any, leg_id: str) -> None: ...  # release a reservation

    def is_alive(self, worker: Any) -> bool: ...  # (a worker that died is asked no more)

    def notify(self, waiter: Waiter) -> None: ...  # news: a grant, an error, an answer, an end

    def capacity(self) -> int: ...  # the live decode pool's tokens (read by a room-sharing order)


class AdmissionCore:
    """The admission's decisions, synchronous: the queue and the asks' bookkeeping."""

    def __init__(self, driver: AdmissionDriver, order: AdmissionOrder | None = None):
        self.driver = driver
        self.order = order if order is not None else ArrivalOrder()
        # tenant -> promised tokens admitted while another tenant had a waiter queued: each
        # tenant's share of contended decode KV (the fairness study reads it, GetStats)
        self.contended_tokens: dict[str, int] = {}
        self.waiters: list[Waiter] = []  # sorted by key
        self._of: dict[int, list[Waiter]] = {}  # id(flight) -> its waiters (a new leg's
        self._seq = itertools.count()  # may queue while its old one is leaving)
        self.round = 0
        self.busy: dict[int, Waiter] = {}  # id(worker) -> the waiter whose call is on it
        self._alive: list | None = None  # the last candidates,
        self._ids: list[int] = []  # and their id()s
        self.held: dict[str, int] = {}  # tenant -> prompt tokens its legs hold on decode

    def __len__(self) -> int:
        return len(self.waiters)

    def hold(self, tenant: str, tokens: int) -> None:
        """A leg of ``tenant`` was placed on a decode worker (until ``unhold``)."""
        self.held[tenant] = self.held.get(tenant, 0) + tokens

    def unhold(self, tenant: str, tokens: int) -> None:
        n = self.held.get(tenant, 0) - tokens
        if n > 0:
            self.held[tenant] = n
        else:  # (tenant names are the clients': none is kept once it holds nothing)
            self.held.pop(tenant, None)

    def within_share(self, tenant: str, tokens: int, waiting: Iterable[str] = ()) -> bool:
        """Whether ``tenant`` may take ``tokens`` more of the decode pool's room: always,
        but under a room-sharing order (wfq) only within its weighted share of the live
        pool among the tenants that hold room or are ``waiting`` for it."""
        if not self.order.shares_room:
            return True
        others = set(self.held).union(waiting)
        others.discard(tenant)
        return not others or self.held.get(tenant, 0) + tokens <= (
            self.driver.capacity() * self.order.share(tenant, others))

    def _past_share(self, waiters: list[Waiter]) -> set[str]:
        """The waiting tenants past their share while another waiting one is within its
        own (only those wait: a pool whose waiters are all past their shares serves them)."""
        if not self.order.shares_room:
            return set()
        tenants = {w.task.tenant for w in waiters if not w.left}
        past = {t for t in tenants if not self.within_share(t, 1, tenants)} \
            if len(tenants) > 1 else set()
        return past if len(past) < len(tenants) else set()

    def enqueue(self, flight: Any, arrival: float, task: Any) -> Waiter:
        key = self.order.key(arrival, task.tenant, task.prompt_len)
        w = Waiter((*key, next(self._seq)), flight, task)
        bisect.insort(self.waiters, w, key=lambda x: x.key)
        self._of.setdefault(id(flight), []).append(w)
        return w

    def promised_on(self, worker: Any) -> bool:
        """Whether a waiter's reserve is in flight on ``worker`` or holds a grant there
        that its leg has not taken yet (a worker leaving its pool drains these too)."""
        return id(worker) in self.busy or any(
            w.held is worker or w.granted is worker for w in self.waiters)

    def idle_head(self, w: Waiter) -> bool:  # it heads the queue, asks none, holds none
        return bool(self.waiters) and self.waiters[0] is w and w.asking is w.held is None

    def wake(self, flight: Any) -> None:
        """Notify `flight`'s waiters (its request ended: they must leave the queue); every
        request that ends calls this, so it looks the waiter up instead of scanning."""
        for w in self._of.get(id(flight), ()):
            self.driver.notify(w)

    def wake_head(self) -> None:  # decode capacity may have freed: a new round
        self.round += 1
        self.pump()

    def take(self, w: Waiter) -> Any:  # the worker `w` was granted (it then leaves), or None
        worker, w.granted = w.granted, None
        if worker is not None:
            self.order.admitted(w.key[:-1])
            tenant = w.task.tenant
            if any(v.task.tenant != tenant for v in self.waiters if not v.left):
                if tenant not in self.contended_tokens and \
                        len(self.contended_tokens) >= MAX_TENANTS:
                    tenant = "other"
                self.contended_tokens[tenant] = \
                    self.contended_tokens.get(tenant, 0) + w.task.prompt_len
        return worker

    def leave(self, w: Waiter) -> None:
        """`w` leaves the queue (admitted, ended, gave up); a reservation it holds goes."""
        w.left = True
        for worker in (w.held, w.granted):
            if worker is not None:  # a reservation it no longer uses
                self.driver.abort_on(worker, w.task.leg_id)
        w.held = w.granted = None
        i = bisect.bisect_left(self.waiters, w.key, key=lambda x: x.key)
        if i < len(self.waiters) and self.waiters[i] is w:
            del self.waiters[i]
        mine = self._of.get(id(w.flight), [])
        if w in mine:
            mine.remove(w)
            if not mine:
                del self._of[id(w.flight)]
        if not self.waiters:
            self.order.idle()
        self.pump()  # later waiters may keep their grants now, or ask its worker

    def answered(self, wt: Waiter, worker: Any, ok: bool, round_: int) -> None:
        """`worker` answered `wt`'s reserve asked in round `round_` (ok: it reserved)."""
        f, leg = wt.flight, wt.task.leg_id
        if ok and (wt.left or f.done or f.leg_id != leg):
            self.driver.abort_on(worker, leg)  # ended while the reserve was in flight
        elif ok:
            wt.held = worker
        elif round_ == self.round:  # a refusal from an older round proves nothing
            self._tried(wt).add(id(worker))
        wt.asking = None
        if self.busy.get(id(worker)) is wt:
            del self.busy[id(worker)]
        self.driver.notify(wt)
        self.pump()

    def _tried(self, w: Waiter) -> set[int]:
        if w.round != self.round:
            w.tried, w.round = set(), self.round
        return w.tried

    def pump(self) -> None:
        """Walk the queue in order: keep the tentative grants that no earlier waiter can
        use any more, and start a reserve for each idle waiter on a free worker."""
        if not self.waiters:
            return
        alive: list = []  # the candidates and the free ones: asked when first needed
        free: set[int] | None = None
        passed: set[int] | None = None  # workers that refused every earlier waiter
        past = self._past_share(waiters := list(self.waiters))
        for wt in waiters:
            if (wt.left or wt.granted is not None or wt.error is not None or wt.flight.done
                    or wt.flight.leg_id != wt.task.leg_id):
                continue  # (an ended request's or leg's waiter is leaving: it asks no more)
            if past and wt.task.tenant in past and wt.held is None:
                continue  # its tenant holds its share: those within theirs go first
            if wt.held is not None and not self.driver.is_alive(wt.held):  # died under its
                self.driver.abort_on(wt.held, wt.task.leg_id)  # tentative grant: undone (if
                wt.held = None  # it lives); it asks again
            if wt.held is not None and (passed is None or id(wt.held) in passed):
                wt.granted, wt.held = wt.held, None
                self.driver.notify(wt)
                continue
            tried = self._tried(wt)
            idle = wt.asking is None and wt.held is None  # (a flag: a narrowed `wt.asking`
            if idle:  # would outlive the _start that sets it, and mypyc checks narrowings)
                alive, free = (alive, free) if free is not None else self._candidates()
                if free:
                    self._start(wt, alive, free, tried)
                if (alive and wt.asking is None and len(tried) >= len(alive)
                        and all(i in tried for i in self._ids)):
                    wt.blocked = True  # refused everywhere: from now on it waits for room
            if wt.blocked:
                break  # nothing behind it asks or keeps a grant (it may need any room)
            passed = set(tried) if passed is None else passed & tried
            if not passed and wt is not waiters[-1] and not (
                    free if free is not None else self._candidates()[1]):
                break  # no later waiter may keep a grant or ask anyone now

    def _candidates(self) -> tuple[list, set[int]]:  # and the id()s of the free ones
        alive, can_ask = self.driver.candidates()
        if alive is not self._alive:  # (a new list when the order changes)
            self._alive, self._ids = alive, [id(w) for w in alive]
        return alive, (set(self._ids).difference(self.busy) if can_ask else set())

    def _start(self, wt: Waiter, alive: list, free: set[int], tried: set[int]) -> None:
        """Ask the first free worker that has not refused `wt` this round, preferring
        one where no later waiter holds a tentative grant (that would be given back)."""
        later: dict[int, list[Waiter]] = {}  # id(worker) -> later waiters holding it
        for v in self.waiters:
            if v.held is not None and v.key > wt.key:
                later.setdefault(id(v.held), []).append(v)
        ok = [w for w, i in zip(alive, self._ids, strict=True) if i in free and i not in tried]
        if not ok:
            return
        w = next((w for w in ok if id(w) not in later), ok[0]) if later else ok[0]
        revoke = later.get(id(w), [])
        for v in revoke:
            v.held = None
        free.discard(id(w))
        self.busy[id(w)] = wt
        wt.asking = w
        self.driver.ask(wt, w, revoke)


class DecodeAdmission:
    """The router's driver of the admission: `admit` calls wait, real reserve calls ask."""

    def __init__(self, router: RouterCore):
        self.router = router
        cfg = router.config
        self.core = AdmissionCore(self, make_admission_order(cfg.admission_order,
                                                             cfg.tenant_weights))
        self.wake_head, self.wake = self.core.wake_head, self.core.wake  # (see the core's)
        self._deadlines: dict[Waiter, float] = {}  # waiter -> its admission_timeout_s end
        self._timer: asyncio.TimerHandle | None = None  # the retry tick, while any wait

    def __len__(self) -> int:
        return len(self.core)

    async def admit(self, flight: Flight, task: DecodeTask,
                    refused: tuple[WorkerHandle, int] | None = None) -> WorkerHandle | None:
        """Wait in the queue until a decode worker reserves room for the leg; None if the
        request ended meanwhile. `refused`: the (worker, round) of a refused reserve."""
        start = time.monotonic()
        grace_end = start + self.router.config.unavailable_grace_s
        limit = self.router.config.admission_timeout_s
        core = self.core
        waiter = core.enqueue(flight, flight.arrival, task)
        waiter.event = event = asyncio.Event()
        if refused and refused[1] == core.round:  # (a refusal counts in its round alone)
            core._tried(waiter).add(id(refused[0]))
        if limit is not None:
            self._deadlines[waiter] = start + limit
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RETRY_S, self._retry)
        try:
            core.pump()
            while True:
                event.clear()  # before the checks: a wake-up from here on is kept
                if flight.done or flight.leg_id != task.leg_id:
                    return None
                if waiter.error is not None:
                    raise waiter.error
                w = core.take(waiter)
                if w is not None:
                    flight.admitted = True
                    return w
                pool = self._dead_pool()
                if pool is not None and time.monotonic() > grace_end:  # no restart came back
                    raise RouterError(ErrorCode.UNAVAILABLE, f"no {pool} worker is alive")
                if limit is not None and time.monotonic() > start + limit:
                    raise RouterError(ErrorCode.RESOURCE_EXHAUSTED,
                                      "no decode worker could admit the request in time "
                                      f"(admission_timeout_s={limit:g})")
                await event.wait()  # (news, or `_retry`: a deadline passed)
        finally:
            self._deadlines.pop(waiter, None)
            core.leave(waiter)
            if not core.waiters and self._timer is not None:  # the last one: no tick
                self._timer.cancel()
                self._timer = None

    def _retry(self) -> None:
        """Every RETRY_S while requests wait, one timer: the head re-asks if it is between
        its tries, and the waiters whose deadline may have passed (admission_timeout_s;
        every one while a pool has no live worker: the grace) look at it."""
        core, self._timer = self.core, None
        if not core.waiters:
            return
        if core.idle_head(core.waiters[0]):
            core.wake_head()
        now, down = time.monotonic(), self._dead_pool() is not None
        for w in core.waiters:
            if down or self._deadlines.get(w, now) < now:
                w.event.set()
        self._timer = asyncio.get_running_loop().call_later(RETRY_S, self._retry)

    def _dead_pool(self) -> str | None:
        """The pool with no live worker ("decode" first), or None."""
        if not any(w.alive for w in self.router.decode):
            return "decode"
        return None if any(w.alive for w in self.router.prefill) else "prefill"

    # ---- AdmissionDriver ------------------------------------------------------------
    def capacity(self) -> int:
        return sum(w.num_blocks * w.block_size for w in self.router.decode if w.alive)

    def candidates(self) -> tuple[list[WorkerHandle], bool]:
        alive = sorted((w for w in self.router.decode if w.alive), key=lambda w: w.kv_usage)
        return alive, bool(alive) and any(w.alive for w in self.router.prefill)

    def notify(self, waiter: Waiter) -> None:
        waiter.event.set()

    def is_alive(self, worker: WorkerHandle) -> bool:
        return worker.alive

    def abort_on(self, worker: WorkerHandle, leg_id: str) -> None:
        self.router.abort_on(worker, leg_id)

    def ask(self, waiter: Waiter, worker: WorkerHandle, revoke: list[Waiter]) -> None:
        self.router.spawn(self._ask(waiter, worker, revoke))

    async def _ask(self, wt: Waiter, w: WorkerHandle, revoke: list[Waiter]) -> None:
        leg, round_, ok = wt.task.leg_id, self.core.round, False
        try:
            for v in revoke:  # give later waiters' room back first, and wait until it is
                with contextlib.suppress(Exception):
                    await w.actor.abort.remote(v.task.leg_id)
                v.event.set()
            try:
                ok = await w.actor.reserve.remote(wt.task)
            except asyncio.CancelledError:  # shut down mid-reserve
                self.router.abort_on(w, leg)
                round_ = -1
                raise
            except ValueError as e:  # can never fit: say so now, not after a wait
                wt.error = RouterError(ErrorCode.RESOURCE_EXHAUSTED, str(e))
            except Exception as e:  # dead worker: skip it (a reserve that landed is undone)
                log.warning("decode %s failed on reserve: %s", w.worker_id, e)
                self.router.abort_on(w, leg)
                self.router.mark_dead(w)
        finally:
            self.core.answered(wt, w, ok, round_)
