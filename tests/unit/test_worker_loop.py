"""WorkerLoop (runtime/loop.py): commands run between steps on the loop thread; a step
that raises fails the legs its engine holds (no request hangs on a broken step), and
after MAX_STEP_FAILURES in a row the engine is declared dead."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from runtime.loop import WorkerLoop
from runtime.messages import EventKind, WorkerEvent


class FlakyEngine:
    """Holds legs; its step raises while `broken`."""

    def __init__(self) -> None:
        self.legs: set[str] = set()
        self.broken = False
        self.last_step_ran = False
        self.thread: str | None = None
        self.stepped = threading.Event()

    @property
    def has_work(self) -> bool:
        return bool(self.legs)

    def add(self, leg_id: str) -> None:
        self.thread = threading.current_thread().name
        self.legs.add(leg_id)

    def step(self) -> list[WorkerEvent]:
        self.stepped.set()
        if self.broken:
            raise RuntimeError("device lost")
        return []

    def fail_all(self, message: str) -> list[WorkerEvent]:
        out = [WorkerEvent(EventKind.FAILED, leg, "w-0", message=message) for leg in self.legs]
        self.legs.clear()
        return out


class Events:
    """A loop's `on_events`: every step's events, in order, for the test thread."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[WorkerEvent] = queue.SimpleQueue()

    def __call__(self, events: list[WorkerEvent]) -> None:
        for ev in events:
            self.q.put(ev)

    def until(self, n: int) -> list[WorkerEvent]:
        got: list[WorkerEvent] = []
        for _ in range(200):  # bounded only to turn a hang into a failure
            try:
                got.append(self.q.get(timeout=0.05))
            except queue.Empty:
                continue
            if len(got) >= n:
                return got
        raise AssertionError(f"got {len(got)} events, wanted {n}")


def test_a_failed_step_fails_the_legs_and_frees_them_and_the_loop_goes_on():
    eng = FlakyEngine()
    got = Events()
    loop = WorkerLoop(eng, max_step_failures=1000, on_events=got)
    try:
        loop.call(lambda: eng.add("a"))
        loop.call(lambda: eng.add("b"))
        assert eng.thread.startswith("worker-loop")  # commands run on the loop thread
        eng.broken = True
        events = got.until(2)
        assert sorted((e.kind, e.leg_id) for e in events) == [
            (EventKind.FAILED, "a"), (EventKind.FAILED, "b")]
        assert all("device lost" in e.message for e in events) and not eng.legs
        eng.broken = False
        loop.call(lambda: eng.add("c"))  # a healthy step resets the count: still serving
        assert loop.alive and loop.fatal is None and "c" in eng.legs
    finally:
        loop.stop()


def test_failing_steps_in_a_row_declare_the_engine_dead():
    eng = FlakyEngine()
    eng.broken = True
    loop = WorkerLoop(eng, max_step_failures=2, on_events=Events())
    try:
        for _ in range(200):  # bounded only to turn a hang into a failure
            if loop.fatal is not None:
                break
            time.sleep(0.05)
        assert loop.fatal == "RuntimeError: device lost" and not loop.alive
        with pytest.raises(RuntimeError, match="device lost"):
            loop.call(lambda: eng.add("c"))
        with pytest.raises(RuntimeError, match="engine died"):
            loop.submit(lambda: None)
    finally:
        loop.stop()


def test_wakes_end_a_nap_at_once_and_a_burst_of_them_queues_one_no_op():
    """A loop whose engine waits on I/O naps `idle_wait_s` between steps (here a minute);
    wake() (a KV arrival) ends the nap. Wakes before the queued no-op ran add nothing;
    after it ran, the next wake queues another."""
    eng = FlakyEngine()
    loop = WorkerLoop(eng, idle_wait_s=60.0, on_events=Events())
    try:
        loop.call(lambda: eng.add("a"))  # work, no step ran: the loop naps a minute
        running, held = threading.Event(), threading.Event()
        loop.submit(lambda: running.set() or held.wait())  # busy while the wakes come
        assert running.wait(5.0)
        for _ in range(5):
            loop.wake()
        assert loop._commands.qsize() == 1  # the burst's one no-op
        held.set()
        loop.call(lambda: None)  # the no-op ran, then this; the loop naps again
        eng.stepped.clear()
        loop.wake()
        assert eng.stepped.wait(30.0)  # well inside the minute: the wake ended the nap
    finally:
        loop.stop()
