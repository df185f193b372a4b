"""LocalBackend: the colocated engine in the server process as a RouterAPI
(`pdserve serve --colocated`).

One `engine.LLM` runs as a runtime.colocated.ColocatedEngine on a runtime.loop.WorkerLoop,
the same engine loop that a Ray colocated worker runs (cluster/launch/colocated_pool.py). The
asyncio side submits adds and aborts to the loop; the loop hands each step's events to
`_publish` (on its thread), which feeds one asyncio.Queue per request with
`loop.call_soon_threadsafe`. Every submission is its own leg (`<request_id>#<n>`), so an
id is free again the moment its request ended, whatever its old leg still reports.
Requests without their first token yet count against `max_queue_len`; past it,
submission fails with RESOURCE_EXHAUSTED instead of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from cluster.router.flight import Flight
from cluster.router.types import (
    ClusterStats,
    ErrorCode,
    GenerateSpec,
    RouterError,
    TokenDelta,
    WorkerStats,
)
from engine.device import local_device
from engine.llm import LLM
from runtime.colocated import ColocatedEngine
from runtime.loop import WorkerLoop
from runtime.messages import EventKind, PrefillTask, WorkerEvent
from runtime.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    """One request's link between the loop thread and its asyncio consumer."""

    flight: Flight
    loop: asyncio.AbstractEventLoop
    leg_id: str
    closed: bool = False  # its last item was sent

    @property
    def queued(self) -> bool:
        return self.flight.first_token_at is None


class LocalBackend:
    """RouterAPI over one engine.LLM (see module docstring); thread-safe submit/abort."""

    def __init__(self, llm: LLM | Callable[[], LLM], *, max_queue_len: int = 256,
                 worker_id: str = "colocated-0", idle_wait_s: float = 0.002):
        """`llm`: the engine, or a function that builds it on the loop thread (as
        `from_config` does: a GPU engine's CUDA graphs belong to the thread that records
        them, runtime.loop.WorkerLoop)."""
        if max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {max_queue_len}")
        self.max_queue_len = max_queue_len
        self.worker_id = worker_id
        self._lock = threading.Lock()  # guards _active, _legs, _accepting
        self._active: dict[str, _Stream] = {}  # by request id
        self._legs: dict[str, _Stream] = {}  # by leg id, until its last item was sent
        self._leg_no = itertools.count(1)
        self._accepting = True
        make = llm if not isinstance(llm, LLM) else (lambda: llm)
        self._loop = WorkerLoop(build=lambda: ColocatedEngine(worker_id, make()),
                                idle_wait_s=idle_wait_s, on_events=self._publish)
        self.engine: ColocatedEngine = self._loop.engine  # type: ignore[assignment]
        self.llm = llm = self.engine.llm
        self.tokenizer = llm.tokenizer  # the front doors' chat templates
        self.vocab_size: int = llm.config.model.vocab_size
        self.max_model_len: int = llm.config.scheduler.max_model_len
        self._last_stats: EngineStats = self._loop.call(self.engine.stats)

    @classmethod
    def from_config(cls, cfg) -> LocalBackend:
        """Build the engine from a ServeConfig (model, cache, scheduler and limits keys)."""
        from cluster.launch.worker_specs import engine_config

        ecfg = engine_config(cfg, str(cfg.model.resolve_path()), "colocated")
        ecfg = replace(ecfg, device=str(local_device(ecfg.device)))
        return cls(lambda: LLM.from_config(ecfg), max_queue_len=cfg.limits.max_queue_len)

    # ---- RouterAPI: asyncio side ------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.llm.encode(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.llm.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenDelta]:
        stream = self._submit(spec)
        done = False
        try:
            while True:
                item = await stream.flight.queue.get()
                if isinstance(item, RouterError):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:  # consumer went away (cancel, close): free the request's blocks
                self._detach(stream)

    def _submit(self, spec: GenerateSpec) -> _Stream:
        rid = spec.request_id
        leg_id = f"{rid}#{next(self._leg_no)}"
        stream = _Stream(Flight(spec, asyncio.Queue(), time.monotonic()),
                         asyncio.get_running_loop(), leg_id)
        with self._lock:
            if self._loop.fatal is not None:
                raise RouterError(ErrorCode.UNAVAILABLE, f"engine is down: {self._loop.fatal}")
            if not self._accepting:
                raise RouterError(ErrorCode.UNAVAILABLE, "backend is shutting down")
            if rid in self._active:
                raise RouterError(ErrorCode.ALREADY_EXISTS, f"request_id {rid!r} is in flight")
            queued = sum(s.queued for s in self._active.values())
            if queued >= self.max_queue_len:
                raise RouterError(ErrorCode.RESOURCE_EXHAUSTED,
                                  f"waiting queue is full ({queued} requests, "
                                  f"limits.max_queue_len={self.max_queue_len}); retry later")
            self._active[rid] = stream
            self._legs[leg_id] = stream
        task = PrefillTask(leg_id, tuple(spec.prompt_token_ids), spec.sampling, "",
                           self.llm.config.model.eos_token_ids, spec.tenant, spec.priority)
        self._on_loop(stream, lambda: self.engine.add(task), self._added)
        return stream

    def _on_loop(self, stream: _Stream, fn, done) -> None:
        """Run `fn` on the engine loop; `done(stream, future)` follows there."""
        try:
            fut = self._loop.submit(fn)
        except RuntimeError as e:  # the loop ended meanwhile
            self._close(stream, RouterError(ErrorCode.UNAVAILABLE, str(e)))
            return
        fut.add_done_callback(lambda f: done(stream, f))

    def _added(self, stream: _Stream, fut: Future) -> None:
        e = fut.exception()
        if e is not None:
            code = ErrorCode.INVALID_ARGUMENT if isinstance(e, ValueError) else \
                ErrorCode.UNAVAILABLE
            self._close(stream, RouterError(code, str(e)))

    def stream(self, request_id: str) -> None:
        """Its deltas go through the handler alone (an asyncio.Queue, no DeltaStream)."""
        return None

    async def abort(self, request_id: str) -> bool:
        with self._lock:
            stream = self._active.get(request_id)
        if stream is not None:
            self._detach(stream)
        return stream is not None

    def _detach(self, stream: _Stream) -> None:
        """The request ended for its client: its id is free at once; the engine aborts
        its leg (and the stream ends with finish_reason "abort" unless it ended first)."""
        self._forget(stream)
        self._on_loop(stream, lambda: self.engine.abort(stream.leg_id), self._aborted)

    def _aborted(self, stream: _Stream, fut: Future) -> None:
        self._close(stream, self._delta(stream, (), "abort"))

    def _forget(self, stream: _Stream) -> None:
        rid = stream.flight.spec.request_id
        with self._lock:
            if self._active.get(rid) is stream:  # not a newer request with the same id
                del self._active[rid]

    async def stats(self) -> ClusterStats:
        s = self._last_stats
        if self._loop.alive:
            with contextlib.suppress(RuntimeError):  # stopped meanwhile: the last ones
                s = await asyncio.wrap_future(self._loop.submit(self.engine.stats))
                self._last_stats = s
        with self._lock:
            queued = sum(st.queued for st in self._active.values())
            inflight = len(self._active)
        worker = WorkerStats(
            worker_id=self.worker_id, role="colocated", alive=self._loop.alive,
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_free=s.kv_blocks_free,
            queue_depth=queued, extra=s.figures())
        return ClusterStats(workers=(worker,), router_queue_depth=queued,
                            num_inflight=inflight, serving=self.healthy())

    def healthy(self) -> bool:
        return self._loop.alive and self._accepting

    async def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting, let running requests finish up to the timeout, abort the rest."""
        with self._lock:
            self._accepting = False
        end = time.monotonic() + drain_timeout_s
        while self._active and time.monotonic() < end and self._loop.alive:
            await asyncio.sleep(0.02)
        with self._lock:
            left = list(self._legs.values())
        for stream in left:
            self._detach(stream)
        await asyncio.get_running_loop().run_in_executor(None, self._loop.stop)
        for stream in left:  # aborts the stopped loop never ran still end their streams
            self._close(stream, self._delta(stream, (), "abort"))

    # ---- loop thread --------------------------------------------------------------------
    def _publish(self, events: list[WorkerEvent]) -> None:
        for ev in events:
            with self._lock:
                stream = self._legs.get(ev.leg_id)
            if stream is None or stream.closed:
                continue
            f = stream.flight
            if ev.kind in (EventKind.FIRST_TOKEN, EventKind.TOKENS):
                f.add_timing(ev.kind, ev.timing)
                if ev.kind == EventKind.FIRST_TOKEN:
                    f.first_token_at = time.monotonic()
                f.generated.extend(ev.token_ids)
                reason = ev.finish_reason.value if ev.finished else None
                delta = replace(self._delta(stream, ev.token_ids, reason),
                                logprobs=ev.logprobs, prompt_logprobs=ev.prompt_logprobs)
                if ev.finished:
                    self._close(stream, delta)
                elif not self._send(stream, delta):
                    self._detach(stream)  # nobody is listening any more
            elif ev.kind == EventKind.FAILED:
                self._close(stream, RouterError(ErrorCode.INTERNAL, ev.message))

    def _delta(self, stream: _Stream, tokens: tuple[int, ...], finish: str | None) -> TokenDelta:
        usage = stream.flight.usage() if finish is not None else None
        return TokenDelta(stream.flight.spec.request_id, tuple(tokens), finish is not None,
                          finish, usage)

    def _send(self, stream: _Stream, item) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.flight.queue.put_nowait, item)
            return True
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            return False

    def _close(self, stream: _Stream, item) -> None:
        """Deliver the last item of a stream (once) and forget it."""
        self._forget(stream)
        with self._lock:
            if stream.closed:
                return
            stream.closed = True
            self._legs.pop(stream.leg_id, None)
        self._send(stream, item)
