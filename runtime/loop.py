"""WorkerLoop: runs an engine's `step()` on one thread and serialises commands into it.

Every engine (PrefillEngine, DecodeEngine, the colocated engine) is single-threaded by
design: commands from other threads (add, abort, reserve, stats) are queued and run on
the loop thread between steps. A step's events go to `on_events` (called on the loop
thread: a worker's control channel, runtime/channel.py, or the server process's own
streams, cluster/launch/local_backend.py). With `every_step`,
`on_events` is called after every step that ran or emitted (even with no events), once
when the engine goes idle, and after the step that follows commands (a reserve on a
worker that waits for KV changes its load with no step running), so a channel can
publish the worker's load. `wake()`
ends a nap early (e.g. KV arrived for a leg that waits on it).

A step that raises fails the legs the engine holds (`fail_all`: FAILED events, resources
freed), so no request hangs on a broken step; after `max_step_failures` failures in a
row the engine is declared dead: the loop stops and `fatal` says why.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from runtime.messages import WorkerEvent

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_STEP_FAILURES = 3


class SteppableEngine(Protocol):
    has_work: bool  # requests in flight (possibly only waiting on I/O)
    last_step_ran: bool  # the last step ran the model

    def step(self) -> list[WorkerEvent]: ...

    def fail_all(self, message: str) -> list[WorkerEvent]:
        """End every leg held here as FAILED (after a step raised), freeing its resources."""
        ...


class WorkerLoop:
    def __init__(self, engine: SteppableEngine | None = None, idle_wait_s: float = 0.002,
                 thread_init: Callable[[], None] | None = None, *,
                 on_events: Callable[[list[WorkerEvent]], None],
                 max_step_failures: int = MAX_STEP_FAILURES, every_step: bool = False,
                 build: Callable[[], SteppableEngine] | None = None):
        """`thread_init` runs first on the loop thread (e.g. binding its CUDA device; the
        engine's ModelRunner also binds every thread that calls it).

        `build` instead of `engine`: the loop thread builds the engine (after
        `thread_init`), and the constructor returns once it is built (raising what the
        build raised). What a GPU engine sets up at start-up belongs to the thread that
        does it: CUDA-graph trees assert on (older torch) or re-record for (newer) a thread
        that did not record them, so a runner built and warmed up on one thread and
        stepped on another lost its graphs."""
        if (engine is None) == (build is None):
            raise ValueError("WorkerLoop needs an engine or a build function (one of them)")
        self.engine = engine  # type: ignore[assignment] - set by `build` on the loop thread
        self._build = build
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread_init = thread_init
        self._on_events = on_events
        self.idle_wait_s = idle_wait_s
        self.max_step_failures = max_step_failures
        self.every_step = every_step
        self.napping = False  # waiting on I/O between steps: wake() ends it
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = \
            queue.SimpleQueue()
        self._wake_queued = False  # a wake()'s no-op waits in _commands
        self._stop = threading.Event()
        self.error: str | None = None  # the last failed step
        self.fatal: str | None = None  # set when the loop gave up: the engine is dead
        name = f"worker-loop:{getattr(engine, 'worker_id', '')}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if build is not None:
            self._built.wait()
            if self._build_error is not None:
                self._stop.set()
                self._thread.join(timeout=10)
                raise self._build_error

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def idle(self) -> bool:
        """Did the last step run no model (nothing to do, or waiting on I/O)?"""
        return not self.engine.last_step_ran

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` for the loop thread; its Future holds the result or exception."""
        if self._stop.is_set():
            raise RuntimeError(f"worker loop is stopped{self._why()}")
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    def command(self, fn: Callable[..., T]) -> Callable[..., Future[T]]:
        """`fn` as a command of this loop: each call queues `fn(*args)` (its Future)."""
        return lambda *args: self.submit(functools.partial(fn, *args))

    def call(self, fn: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run `fn` on the loop thread and return its result (exceptions propagate)."""
        return self.submit(fn).result(timeout=timeout)

    def wake(self) -> None:
        """End the current nap (a no-op command); harmless when the loop is busy. Wakes
        before that no-op runs add nothing: it has yet to end a nap, and the step after it
        sees everything they announced."""
        if not self._stop.is_set() and not self._wake_queued:
            self._wake_queued = True
            self._commands.put((self._woken, Future()))

    def _woken(self) -> None:
        self._wake_queued = False

    def _why(self) -> str:
        return f" (engine died: {self.fatal})" if self.fatal else ""

    def _drain_commands(self, block_s: float) -> bool:
        """Run the queued commands (waiting up to ``block_s`` for one); did any run?"""
        try:
            fn, fut = self._commands.get(timeout=block_s) if block_s > 0 else \
                self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - reported to the caller
                    fut.set_exception(e)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self, failures: int) -> tuple[list[WorkerEvent], int]:
        try:
            return self.engine.step(), 0
        except Exception as e:  # a step must never kill the loop silently
            failures += 1
            log.exception("engine step failed (%d in a row)", failures)
            self.error = f"{type(e).__name__}: {e}"
        try:
            events = self.engine.fail_all(f"engine step failed: {self.error}")
        except Exception:
            log.exception("failing the legs of a failed step failed too")
            events = []
        if failures >= self.max_step_failures:
            self.fatal = self.error
            self._stop.set()  # from now on commands are refused
        return events, failures

    def _run(self) -> None:
        failures = 0
        was_busy = commanded = False
        if self._thread_init is not None:
            try:
                self._thread_init()
            except Exception as e:  # reported like a failed step; the loop still serves
                log.exception("worker loop thread init failed")
                self.error = f"{type(e).__name__}: {e}"
        if self._build is not None:
            try:
                self.engine = self._build()
            except BaseException as e:  # noqa: BLE001 - raised by the constructor
                self._build_error = e
                return
            finally:
                self._built.set()
            self._thread.name = f"worker-loop:{getattr(self.engine, 'worker_id', '')}"
        while not self._stop.is_set() and self.fatal is None:
            events, failures = self._step(failures)
            ran = self.engine.last_step_ran
            if events or (self.every_step and (ran or was_busy or commanded)):
                self._on_events(events)
            was_busy = ran or bool(events)
            if self.fatal is not None:
                break
            if failures:  # let a transient cause (e.g. memory) pass before the next try
                time.sleep(0.1)
            # busy: take commands between steps without waiting; waiting on I/O: a short
            # nap; idle: sleep until a command arrives (or 50 ms, to notice stop)
            if ran:
                wait = 0.0
            else:
                wait = self.idle_wait_s if self.engine.has_work else 0.05
            self.napping = wait > 0
            commanded = self._drain_commands(wait)
            self.napping = False
        if self.fatal is not None:
            self._reject_commands()

    def _reject_commands(self) -> None:
        """Commands queued before the engine died get an error, not a hang."""
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"worker loop is stopped{self._why()}"))

    def stop(self) -> None:
        self._stop.set()
        self._commands.put((self._woken, Future()))  # ends a nap at once
        self._thread.join(timeout=10)
