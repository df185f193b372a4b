"""WorkerLoop: runs an engine's `step()` on one thread and serialises commands into it.

The engine (PrefillEngine / DecodeEngine) is single-threaded by design: commands from
the actor's RPC threads (add, abort, reserve, stats) are queued and executed on the loop
thread between steps; events are buffered in an outbox that `poll` long-polls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from engine.messages import WorkerEvent

log = logging.getLogger(__name__)


class SteppableEngine(Protocol):
    has_work: bool  # requests in flight (possibly only waiting on I/O)
    last_step_ran: bool  # the last step ran the model

    def step(self) -> list[WorkerEvent]: ...


class WorkerLoop:
    def __init__(self, engine: SteppableEngine, idle_wait_s: float = 0.002,
                 thread_init: Callable[[], None] | None = None):
        """`thread_init` runs first on the loop thread (e.g. binding its CUDA device; the
        engine's ModelRunner also binds every thread that calls it)."""
        self.engine = engine
        self._thread_init = thread_init
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._outbox: list[WorkerEvent] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="worker-loop", daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """Run `fn` on the loop thread and return its result (exceptions propagate)."""
        if self._stop.is_set():
            raise RuntimeError("worker loop is stopped")
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut.result(timeout=timeout)

    def poll(self, timeout_s: float) -> list[WorkerEvent]:
        """Events since the last poll; waits up to `timeout_s` for the first one."""
        with self._cond:
            if not self._outbox:
                self._cond.wait(timeout_s)
            out, self._outbox = self._outbox, []
        return out

    def _drain_commands(self, block_s: float) -> None:
        try:
            fn, fut = self._commands.get(timeout=block_s) if block_s > 0 else \
                self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - reported to the caller
                    fut.set_exception(e)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        if self._thread_init is not None:
            try:
                self._thread_init()
            except Exception as e:  # reported like a failed step; the loop still serves
                log.exception("worker loop thread init failed")
                self.error = f"{type(e).__name__}: {e}"
        while not self._stop.is_set():
            try:
                events = self.engine.step()
            except Exception as e:  # a step must never kill the loop silently
                log.exception("engine step failed")
                self.error = f"{type(e).__name__}: {e}"
                events = []
                time.sleep(0.1)
            if events:
                with self._cond:
                    self._outbox.extend(events)
                    self._cond.notify_all()
            # busy: take commands between steps without waiting; waiting on I/O: a short
            # nap; idle: sleep until a command arrives (or 50 ms, to notice stop)
            if self.engine.last_step_ran:
                wait = 0.0
            else:
                wait = self.idle_wait_s if self.engine.has_work else 0.05
            self._drain_commands(wait)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
