"""LocalBackend: the colocated baseline as a RouterAPI (`pdserve serve --colocated`).

One `engine.LLM` runs its step loop in a background thread that alone touches the
engine. The asyncio side talks to it through a command queue (add / abort / stop) and
gets tokens back through one asyncio.Queue per request, fed with
`loop.call_soon_threadsafe`. Requests submitted but not yet scheduled count against
`max_queue_len`; past it, submission fails with RESOURCE_EXHAUSTED instead of waiting.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cluster.types import (
    ClusterStats,
    ErrorCode,
    GenerateSpec,
    RouterError,
    TokenDelta,
    Usage,
    WorkerStats,
)
from engine.request import Request, RequestStatus

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine is declared dead (healthy() -> False)


@dataclass
class _Stream:
    """One request's link between the engine thread and its asyncio consumer."""

    spec: GenerateSpec
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    request: Request | None = None  # engine thread only, from here down
    started: float | None = None  # first scheduled
    sent: int = 0  # output tokens already delivered
    closed: bool = False  # its last item was sent


class LocalBackend:
    """RouterAPI over one engine.LLM (see module docstring); thread-safe submit/abort."""

    def __init__(self, llm, *, max_queue_len: int = 256, worker_id: str = "colocated-0",
                 idle_wait_s: float = 0.05):
        if max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {max_queue_len}")
        self.llm = llm
        self.tokenizer = llm.tokenizer  # the front doors' chat templates
        self.vocab_size: int = llm.config.model.vocab_size
        self.max_model_len: int = llm.config.scheduler.max_model_len
        self.max_queue_len = max_queue_len
        self.worker_id = worker_id
        self.idle_wait_s = idle_wait_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _active, _queued, _accepting
        self._active: dict[str, _Stream] = {}
        self._queued: set[str] = set()  # submitted, not scheduled yet
        self._accepting = True
        self._fatal: str | None = None
        self._snapshot: dict[str, float] = dict(llm.stats())
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg) -> LocalBackend:
        """Build the engine from a ServeConfig (model, cache, scheduler and limits keys)."""
        from engine.llm import LLM

        m, c, s = cfg.model, cfg.cache, cfg.scheduler
        llm = LLM(str(m.resolve_path()), block_size=c.block_size,
                  max_num_batched_tokens=s.max_num_batched_tokens,
                  max_prefill_chunk=s.max_prefill_chunk,
                  enable_chunked_prefill=s.enable_chunked_prefill,
                  enable_prefix_caching=c.enable_prefix_caching, num_blocks=c.num_blocks,
                  device=m.resolved_device, dtype=m.dtype, attention_backend=m.attention_backend,
                  compile=m.compile,
                  max_num_seqs=s.max_num_seqs, max_model_len=m.max_model_len,
                  kv_cache_memory_bytes=c.kv_cache_memory_bytes,
                  gpu_memory_utilization=c.gpu_memory_utilization)
        return cls(llm, max_queue_len=cfg.limits.max_queue_len)

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
                item = await stream.queue.get()
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
        stream = _Stream(spec, asyncio.get_running_loop())
        rid = spec.request_id
        with self._lock:
            if self._fatal is not None:
                raise RouterError(ErrorCode.UNAVAILABLE, f"engine is down: {self._fatal}")
            if not self._accepting:
                raise RouterError(ErrorCode.UNAVAILABLE, "backend is shutting down")
            if rid in self._active:
                raise RouterError(ErrorCode.ALREADY_EXISTS, f"request_id {rid!r} is in flight")
            if len(self._queued) >= self.max_queue_len:
                raise RouterError(ErrorCode.RESOURCE_EXHAUSTED,
                                  f"waiting queue is full ({len(self._queued)} requests, "
                                  f"limits.max_queue_len={self.max_queue_len}); retry later")
            self._active[rid] = stream
            self._queued.add(rid)
        self._cmds.put(("add", stream))
        return stream

    async def abort(self, request_id: str) -> bool:
        with self._lock:
            stream = self._active.get(request_id)
        if stream is not None:
            self._detach(stream)
        return stream is not None

    def _detach(self, stream: _Stream) -> None:
        """The request ended for its client: its id is free at once; the engine thread
        aborts it (commands run in order: before any later request with the same id)."""
        self._forget(stream)
        self._cmds.put(("abort", stream))

    def _forget(self, stream: _Stream) -> None:
        rid = stream.spec.request_id
        with self._lock:
            if self._active.get(rid) is stream:  # not a newer request with the same id
                del self._active[rid]
                self._queued.discard(rid)

    async def stats(self) -> ClusterStats:
        snap = self._snapshot  # replaced atomically by the engine thread
        with self._lock:
            queued, inflight = len(self._queued), len(self._active)
        worker = WorkerStats(
            worker_id=self.worker_id, role="colocated", alive=self._alive(),
            num_running=int(snap["num_requests_running"]),
            num_waiting=int(snap["num_requests_waiting"]),
            kv_blocks_used=int(snap["kv_blocks_used"]),
            kv_blocks_free=int(snap["kv_blocks_free"]), queue_depth=queued,
            extra={k: float(v) for k, v in snap.items() if not k.startswith(("num_", "kv_b"))})
        return ClusterStats(workers=(worker,), router_queue_depth=queued,
                            num_inflight=inflight, serving=self.healthy())

    def _alive(self) -> bool:
        return self._thread.is_alive() and self._fatal is None

    def healthy(self) -> bool:
        return self._alive() and self._accepting

    async def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting, let running requests finish up to the timeout, abort the rest."""
        with self._lock:
            self._accepting = False
        end = time.monotonic() + drain_timeout_s
        while self._active and time.monotonic() < end and self._thread.is_alive():
            await asyncio.sleep(0.02)
        self._cmds.put(("stop", None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    # ---- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        try:
            self.llm.runner.bind()  # Triton launches on this thread's current CUDA device
            while True:
                if not self._handle_commands(block=not self.llm.has_unfinished()):
                    break
                if self.llm.has_unfinished():
                    step_start = time.monotonic()
                    try:
                        touched = self.llm.step()
                        failures = 0
                    except Exception as e:  # never let one bad step kill the loop
                        failures += 1
                        log.exception("engine step failed (%d in a row)", failures)
                        self._fail_all(ErrorCode.INTERNAL, f"engine step failed: {e}")
                        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                            raise
                        continue
                    self._publish(touched, step_start)
                self._snapshot = dict(self.llm.stats())
        except BaseException as e:
            self._fatal = f"{type(e).__name__}: {e}"
            log.exception("engine loop died")
        finally:
            self._fail_all(ErrorCode.UNAVAILABLE, "backend shut down", finish="abort")
            self._end_detached()
            self._snapshot = dict(self.llm.stats())

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; False on stop."""
        try:
            cmd = self._cmds.get(timeout=self.idle_wait_s) if block else self._cmds.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = cmd
            if kind == "stop":
                return False
            (self._add if kind == "add" else self._abort)(arg)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _add(self, stream: _Stream) -> None:
        spec = stream.spec
        try:
            req = self.llm.add_request(list(spec.prompt_token_ids), spec.sampling,
                                       request_id=spec.request_id)
        except ValueError as e:
            self._close(stream, RouterError(ErrorCode.INVALID_ARGUMENT, str(e)))
            return
        req.tenant = spec.tenant
        stream.request = req

    def _abort(self, stream: _Stream) -> None:
        if stream.request is None or stream.request.is_finished or stream.closed:
            return
        self.llm.abort(stream.spec.request_id)
        self._close(stream, self._delta(stream, "abort"))

    def _publish(self, touched: list[Request], step_start: float) -> None:
        with self._lock:
            waiting = [self._active[r] for r in self._queued if r in self._active]
        for stream in waiting:
            r = stream.request
            if r is not None and (r.status != RequestStatus.WAITING or r.num_computed_tokens):
                stream.started = step_start
                with self._lock:
                    self._queued.discard(stream.spec.request_id)
        for r in touched:
            stream = self._active.get(r.request_id)
            if stream is None or stream.request is not r:
                continue
            if r.is_finished:
                self._close(stream, self._delta(stream, r.finish_reason.value))
            elif len(r.output_token_ids) > stream.sent:
                if not self._send(stream, self._delta(stream, None)):
                    self._abort(stream)  # nobody is listening any more

    def _delta(self, stream: _Stream, finish: str | None) -> TokenDelta:
        r = stream.request
        new = tuple(r.output_token_ids[stream.sent:]) if r is not None else ()
        stream.sent += len(new)
        usage = None
        if finish is not None and r is not None:
            usage = _usage(r, stream.arrival, stream.started, time.monotonic())
        return TokenDelta(stream.spec.request_id, new, finish is not None, finish, usage)

    def _send(self, stream: _Stream, item) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            return True
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            return False

    def _close(self, stream: _Stream, item) -> None:
        """Deliver the last item of a stream and forget it."""
        self._forget(stream)
        stream.closed = True
        self._send(stream, item)

    def _fail_all(self, code: ErrorCode, message: str, finish: str | None = None) -> None:
        with self._lock:
            streams = list(self._active.values())
        for stream in streams:
            rid = stream.spec.request_id
            if stream.request is not None and not stream.request.is_finished:
                try:
                    self.llm.abort(rid)
                except Exception:
                    log.exception("abort of %s failed", rid)
            item = self._delta(stream, finish) if finish else RouterError(code, message)
            self._close(stream, item)


    def _end_detached(self) -> None:
        """After the loop: a detached stream whose abort never ran still gets its end."""
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "abort" and not arg.closed:
                self._close(arg, self._delta(arg, "abort"))


def _usage(r: Request, arrival: float, started: float | None, now: float) -> Usage:
    """Usage of a finished request; all intervals on this process's monotonic clock."""
    first = r.first_token_time
    started = started if started is not None else (first or now)
    return Usage(
        prompt_tokens=r.num_prompt_tokens, completion_tokens=len(r.output_token_ids),
        cached_prompt_tokens=r.prefix_hit_tokens,
        ttft_s=(first - arrival) if first else 0.0,
        queue_s=max(0.0, started - arrival),
        prefill_s=max(0.0, first - started) if first else 0.0,
        decode_s=(now - first) if first else 0.0,
        e2e_s=now - arrival,
    )
