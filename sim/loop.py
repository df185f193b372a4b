"""The discrete-event loop: a simulated clock and a heap of timed callbacks.

Events at the same time run in the order they were scheduled (a sequence number breaks
ties), so a run is a pure function of its inputs: no wall clock, no hash order.

    loop = EventLoop()
    loop.at(0.5, worker.on_command, task)
    loop.run()            # loop.now is the time of the last event
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any


class EventLoop:
    __slots__ = ("now", "_heap", "_seq", "events_run")

    def __init__(self, start: float = 0.0):
        self.now = start
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.events_run = 0

    def __call__(self) -> float:
        """The simulated time (a clock for PrefillScheduler and LinkScheduler)."""
        return self.now

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at simulated time ``t`` (never before now)."""
        if t < self.now:
            raise ValueError(f"cannot schedule at {t!r}, before now ({self.now!r})")
        self._seq += 1
        heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` ``dt`` >= 0 seconds from now."""
        if not dt >= 0:
            raise ValueError(f"cannot schedule {dt!r} s from now")
        self._seq += 1
        heappush(self._heap, (self.now + dt, self._seq, fn, args))

    def run(self, until: float = float("inf")) -> None:
        """Run events in time order until none is left or the next is after ``until``."""
        heap, pop = self._heap, heappop
        n = 0
        if until == float("inf"):  # (the whole run: no bound to check per event)
            while heap:
                t, _, fn, args = pop(heap)
                self.now = t
                fn(*args)
                n += 1
        while heap:
            if heap[0][0] > until:
                break
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            n += 1
        self.events_run += n

    def __len__(self) -> int:
        return len(self._heap)
