"""The router's decode admission on the simulated clock (cluster/admission.py).

Legs wait in arrival order (a re-dispatched leg keeps its request's arrival, so it goes
ahead of newer requests). Only the head asks the decode workers for room, one reserve
call at a time, in the order of the configured decode-order policy
(cluster/routing_policies.py; today's: least KV usage as the router last saw it). When no
one had room, the head tries again as soon as a leg ends anywhere (``wake_head``) or
after ``RETRY_S``; a wake-up during its round makes it retry at once.
"""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING

from sim.adapters import ADMISSION_RETRY_S, decode_order, decode_task

if TYPE_CHECKING:
    from sim.router import Flight, SimRouter


class SimAdmission:
    def __init__(self, router: SimRouter):
        self.router, self.loop, self.sim = router, router.loop, router.sim
        self._queue: list[tuple[float, int, Flight]] = []
        self._seq = itertools.count()
        self._round: Flight | None = None
        self._woken = False
        self._retry_version = 0
        self._due = -1.0

    def __len__(self) -> int:
        return len(self._queue)

    def enqueue(self, flight: Flight) -> None:
        bisect.insort(self._queue, (flight.arrival, next(self._seq), flight),
                      key=lambda w: (w[0], w[1]))
        self.wake_head()

    def forget(self, flight: Flight) -> None:
        """The request ended: it leaves the queue (after its round, if it is asking)."""
        if self._round is not flight:
            self._queue = [e for e in self._queue if e[2] is not flight]

    def wake_head(self) -> None:
        if self._round is not None:
            self._woken = True
        elif self._queue and self._due != self.loop.now:
            self._due = self.loop.now  # one try per instant is enough
            self._retry_version += 1
            self.loop.at(self.loop.now, self._try_head, self._retry_version)

    def _try_head(self, version: int) -> None:
        self._due = -1.0
        if version != self._retry_version or self._round is not None:
            return
        while self._queue and self._queue[0][2].done:
            self._queue.pop(0)
        if not self._queue:
            return
        head = self._queue[0][2]
        self._round, self._woken = head, False
        order = decode_order(self.sim.options.decode_order, self.router.decode_loads)
        self._ask(head, head.leg_id, order, 0)

    def _ask(self, flight: Flight, leg: str, order: list[str], i: int) -> None:
        w = self.router.decode_by_id[order[i]]
        task = decode_task(leg, flight.leg_prompt_len, flight.req.max_tokens - flight.generated,
                           flight.req.tenant)

        def reply(ok: bool, error: str | None) -> None:
            self.sim.emit(self._reply, flight, leg, order, i, ok, error)

        self.sim.emit(w.command, w.reserve, task, reply)

    def _reply(self, flight: Flight, leg: str, order: list[str], i: int, ok: bool,
               error: str | None) -> None:
        w = self.router.decode_by_id[order[i]]
        stale = flight.done or flight.leg_id != leg
        if ok and stale:
            self.router.abort_on(w, leg)
        if error is not None and not stale:
            self._end_round(flight)
            return self.router.fail(flight, f"RESOURCE_EXHAUSTED: {error}")
        if stale or ok:
            self._end_round(flight)
            if ok and not stale:
                self.router.place(flight, w)
            return
        if i + 1 < len(order):
            return self._ask(flight, leg, order, i + 1)
        self._round = None  # nobody had room: retry on a wake-up, or after RETRY_S
        if self._woken:
            self.wake_head()
        else:
            self._retry_version += 1
            self.loop.at(self.loop.now + ADMISSION_RETRY_S, self._try_head,
                         self._retry_version)

    def _end_round(self, flight: Flight) -> None:
        self._round = None
        self._queue = [e for e in self._queue if e[2] is not flight]
        self.wake_head()

