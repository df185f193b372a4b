"""A simulated worker loop: runtime/loop.py WorkerLoop on the simulated clock.

The real loop runs ``engine.step()`` back to back while steps run the model; between
steps it executes the commands that arrived (add, reserve, abort). A step that ran
nothing is followed by a nap -- ``idle_wait_s`` while requests wait on I/O, 50 ms when
idle -- that a command cuts short. Here a step has a duration from the cost model;
commands that arrive during a step wait for its end; a worker that naps wakes for a
command at once and for I/O (a KV frame, an ack) at the next tick of its nap.

Subclasses implement ``start_step() -> (duration, ran_model) | None`` (the step's
decisions, taken at its start as the real scheduler does) and ``end_step()`` (its effects).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from sim.cluster import Simulation

IDLE_NAP_S = 0.05  # WorkerLoop._run: an idle loop sleeps this long between checks


class SimWorker:
    role: ClassVar[str] = ""

    def __init__(self, sim: Simulation, worker_id: str):
        self.sim = sim
        self.loop = sim.loop
        self.costs = sim.costs
        self.worker_id = worker_id
        self.stepping = False
        self.step_end = 0.0
        self._commands: list[tuple[Callable[..., Any], tuple]] = []
        self._nap_origin = 0.0  # ticks of the current nap: origin + k * period
        self._tick_version = 0  # a pending tick event is stale once this moves
        self._tick_at: float | None = None
        self._end_version = 0
        self._ran = False

    # ---- to implement -------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        raise NotImplementedError

    def start_step(self) -> tuple[float, bool] | None:
        raise NotImplementedError

    def end_step(self) -> None:
        raise NotImplementedError

    # ---- the loop -----------------------------------------------------------------
    def command(self, fn: Callable[..., Any], *args: Any) -> None:
        """A command arrives now: it runs between steps (now, if the loop naps)."""
        if self.stepping:
            self._commands.append((fn, args))
            return
        fn(*args)
        self._run_step()

    def io_ready(self) -> None:
        """Something the next step() would take arrived (KV frames, acks)."""
        if self.stepping:
            return
        period = self.sim.idle_wait_s if self.has_work else IDLE_NAP_S
        now = self.loop.now
        k = math.ceil((now - self._nap_origin) / period - 1e-9)
        t = max(self._nap_origin + max(k, 0) * period, now)  # (rounding of k * period)
        if self._tick_at is not None and self._tick_at <= t:
            return  # an earlier tick is already due
        self._tick_version += 1
        self._tick_at = t
        self.loop.at(t, self._tick, self._tick_version)

    def wake(self) -> None:
        """A doorbell: I/O that ends the nap at once (decode_worker/worker.py wakes its loop
        when KV arrives); during a step it waits for the step's end, as commands do."""
        if not self.stepping:
            self._run_step()

    def _tick(self, version: int) -> None:
        if version != self._tick_version or self.stepping:
            return
        self._tick_at = None
        self._run_step()

    def _run_step(self) -> None:
        self._tick_version += 1
        self._tick_at = None
        began = self.start_step()
        if began is None:
            self._nap_origin = self.loop.now
            return
        duration, self._ran = began
        self.stepping = True
        t = self.step_end = self.loop.now + duration  # (reschedule_end, inlined)
        self._end_version += 1
        self.loop.at(t, self._finish_if, self._end_version)

    def _finish_step(self) -> None:
        self.end_step()
        self.stepping = False
        if self._commands:
            commands, self._commands = self._commands, []
            for fn, args in commands:
                fn(*args)
        if self._ran:
            self._run_step()
        else:  # nothing ran: nap; I/O that came meanwhile is taken at the first tick
            self._nap_origin = self.loop.now
            if self.pending_io():
                self.io_ready()

    def pending_io(self) -> bool:
        """Whether I/O is waiting for the next step (subclasses with an inbox override)."""
        return False

    def reschedule_end(self, t: float) -> None:
        """(Re)set when the running step ends (a macro step is cut at a step boundary)."""
        self.step_end = t
        self._end_version += 1
        self.loop.at(t, self._finish_if, self._end_version)

    def _finish_if(self, version: int) -> None:
        if version == self._end_version:
            self._finish_step()
