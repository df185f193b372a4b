"""AdmissionQueue: requests waiting for a decode reservation, served in arrival order.

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
import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Waiter:
    key: tuple[float, int]  # (arrival, tie-break): the queue's order
    flight: Any
    event: asyncio.Event = field(default_factory=asyncio.Event)


class AdmissionQueue:
    def __init__(self) -> None:
        self._waiters: list[Waiter] = []  # sorted by key
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def enqueue(self, flight: Any, arrival: float) -> Waiter:
        w = Waiter((arrival, next(self._seq)), flight)
        bisect.insort(self._waiters, w, key=lambda x: x.key)
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
        if was_head:
            self.wake_head()

    def wake_head(self) -> None:
        if self._waiters:
            self._waiters[0].event.set()

    def wake(self, flight: Any) -> None:
        """Wake `flight`'s waiter (its request ended: it must leave the queue)."""
        for w in self._waiters:
            if w.flight is flight:
                w.event.set()

    def position(self, flight: Any) -> int | None:
        """0 for the head; None when `flight` is not waiting."""
        return next((i for i, w in enumerate(self._waiters) if w.flight is flight), None)
