"""The router's decode admission on the simulated clock: the real AdmissionCore
(cluster/router/admission.py: arrival order, one reserve in flight per decode worker, tentative
and kept grants, a waiter refused everywhere blocks those behind it), driven as
DecodeAdmission drives it, with simulated reserve calls.

Each waiter does what the router's ``admit`` loop does when it wakes (a notify reaches
it later in the same instant, as an asyncio.Event set does; the waiters an answer woke,
right after the answer is taken in): it leaves when its request ended, fails with its
error, is placed with its grant, else waits again. One tick runs every ``RETRY_S`` from
when the queue stops being empty until it is empty again (DecodeAdmission._retry): a
head between its tries then starts a new round; it wakes no other waiter (the router's
tick also wakes those past ``admission_timeout_s``, which is not simulated). Workers are
asked in the configured decode-order policy's order (cluster/router/policies.py). Modelled: the revoked grants go back in one
abort call before the reserve (the router awaits one abort per grant).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from sim.adapters import ADMISSION_RETRY_S, AdmissionCore, Waiter, decode_order, decode_task

if TYPE_CHECKING:
    from sim.decode import SimDecode
    from sim.router import Flight, SimRouter


class SimAdmission:
    def __init__(self, router: SimRouter):
        self.router, self.loop, self.sim = router, router.loop, router.sim
        self.core = AdmissionCore(self)
        self._order: list[SimDecode] | None = None  # cached until a decode load changes
        self._last: list[SimDecode] = []  # the order last given
        self._tick = 0  # the running tick's number (a new one each time the queue fills)
        self._woken: list[Waiter] | None = None  # waiters an answer woke (while taken in)

    def __len__(self) -> int:
        return len(self.core)

    def capacity(self) -> int:  # AdmissionDriver: the live decode pool's tokens (the router's)
        return sum(d.bm.num_blocks * d.bm.block_size for d in self.sim.decode)

    def enqueue(self, flight: Flight, refused: tuple | None = None) -> None:
        """DecodeAdmission.admit's start; ``refused``: the (worker, round) of a refused
        reserve sent with the add (it counts in its round alone)."""
        req = flight.req
        task = decode_task(flight.leg_id, flight.leg_prompt_len,
                           req.max_tokens - flight.generated, req.tenant)
        if not self.core.waiters:  # the router's tick stopped when the queue emptied
            self._tick += 1
            self.loop.at(self.loop.now + ADMISSION_RETRY_S, self._retry, self._tick)
        wt = self.core.enqueue(flight, flight.arrival, task)
        wt.event = [False]  # [a wake-up is due]
        if refused and refused[1] == self.core.round:
            self.core._tried(wt).add(id(refused[0]))
        self.core.pump()
        self._wake_up(wt)

    def forget(self, flight: Flight) -> None:
        """The request ended: its waiter leaves the queue (when it wakes up)."""
        self.core.wake(flight)

    def wake_head(self) -> None:
        self.core.wake_head()

    def loads_changed(self) -> None:
        self._order = None

    # ---- AdmissionDriver ------------------------------------------------------------
    def candidates(self) -> tuple[list[SimDecode], bool]:
        if self._order is None:
            by_id = self.router.decode_by_id
            order = [by_id[w] for w in decode_order(self.sim.options.decode_order,
                                                    self.router.decode_loads)]
            # the same order keeps the same list: the core then keeps its id()s of it
            self._order = self._last if order == self._last else order
            self._last = self._order
        return self._order, True

    def notify(self, wt: Waiter) -> None:
        if not wt.event[0]:
            wt.event[0] = True
            if self._woken is not None:  # it wakes once the answer is taken in
                self._woken.append(wt)
            else:
                self.loop.at(self.loop.now, self._wake_up, wt)

    def is_alive(self, worker: SimDecode) -> bool:
        return True  # (worker death is not simulated)

    def abort_on(self, worker: SimDecode, leg_id: str) -> None:
        self.router.abort_on(worker, leg_id)

    def ask(self, wt: Waiter, w: SimDecode, revoke: list[Waiter]) -> None:
        emit, reply = self.sim.emit, partial(self._reply, wt, w, self.core.round)
        if not revoke:
            return emit(w.command, w.reserve, wt.task, reply)

        def give_back() -> None:
            for v in revoke:
                w.abort(v.task.leg_id)
            emit(reserve)

        def reserve() -> None:
            for v in revoke:
                self.notify(v)
            emit(w.command, w.reserve, wt.task, reply)

        emit(w.command, give_back)

    def _reply(self, wt: Waiter, w: SimDecode, round_: int, ok: bool,
               error: str | None) -> None:  # (on the worker: the answer travels back)
        self.sim.emit(self._answered, wt, w, ok, error, round_)

    def _answered(self, wt: Waiter, w: SimDecode, ok: bool, error: str | None,
                  round_: int) -> None:
        if error is not None:  # it can never fit: say so now, not after a wait
            wt.error = f"RESOURCE_EXHAUSTED: {error}"
        woken: list[Waiter] = []
        self._woken = woken
        try:
            self.core.answered(wt, w, ok, round_)
        finally:
            self._woken = None
        for v in woken:  # (outside the core's walk: one may leave, and the core walks again)
            self._wake_up(v)

    # ---- the waiter's admit loop ----------------------------------------------------
    def _wake_up(self, wt: Waiter) -> None:
        wt.event[0] = False
        if wt.left:
            return
        f: Any = wt.flight
        if f.done or f.leg_id != wt.task.leg_id:
            return self.core.leave(wt)
        if wt.error is not None:
            self.core.leave(wt)
            return self.router.fail(f, wt.error)
        w = self.core.take(wt)
        if w is not None:
            self.core.leave(wt)
            return self.router.place(f, w)
        # else it waits for a wake-up

    def _retry(self, tick: int) -> None:
        """DecodeAdmission._retry, every RETRY_S while anyone waits: a head between its
        tries re-asks."""
        waiters = self.core.waiters
        if tick != self._tick or not waiters:
            return  # (the queue emptied since: this tick was cancelled)
        if self.core.idle_head(waiters[0]):
            self.core.wake_head()
        self.loop.at(self.loop.now + ADMISSION_RETRY_S, self._retry, tick)
