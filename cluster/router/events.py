"""EventPump: receives every worker's events and applies them to the router's flights
(cluster/router/liveness.py watches the workers themselves).

A worker with a control channel (`WorkerHandle.channel`, runtime/channel.py) sends one
message per step with every leg's events and its load; `on_batch` applies it on the
loop with no task, Future or Ray call per event: a common token (no finish or log-probs,
stream_interval 1) of a byte-table tokenizer goes to its stream with its text at once,
the rest to the detokenizer in one batch (`deliver`). Every worker has a channel (a
test's scripted worker an in-process one): it is the only way events come in.

A re-dispatch (which may queue for decode admission) runs as its own task, so one
preemption cannot delay the other streams of that worker. An event counts only when it
comes from the worker that holds the leg in that role. A flight's tokens are released
every `stream_interval` tokens (the first token and the last message at once); a decode
worker reports them at the same points (decode_worker/engine.py), so at N > 1 a step's
message carries a token for one leg in N and this loop handles a leg's N tokens at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from cluster.router.flight import Flight, RouterCore
from cluster.router.liveness import Liveness
from cluster.router.pool import WorkerHandle
from cluster.router.types import ErrorCode, RouterError, TokenDelta
from cluster.router.upkeep import Upkeep
from engine.detokenize import DetokenizerThread
from runtime.batch_codec import FINISH_OF, entry_event
from runtime.messages import EventKind, LegTiming, WorkerEvent

log = logging.getLogger(__name__)


# [(flight, token_ids, finished, finish_reason, usage, logprobs, prompt_logprobs)] of a batch
Delivery = list

class EventPump:
    def __init__(self, router: RouterCore, channel_secret: bytes = b""):
        self.router = router
        self.channel_secret = channel_secret
        self._tasks: list[asyncio.Task] = []
        self.stopping = False
        self._interval = router.config.stream_interval  # (the config is frozen)
        self._every_token = self._interval == 1
        self._gaps = router.config.adaptive_chunks
        self.liveness = Liveness(self)
        self.upkeep = Upkeep(router)
        self._detok: DetokenizerThread | None = None
        self.decode_pressure = self.upkeep.decode_pressure
        self.waiting_on_prefill = self.upkeep.waiting_on_prefill
        self.collect_stats = self.upkeep.collect_stats
        self.collect_traces = self.upkeep.collect_traces

    def deliver(self, out: Delivery) -> None:
        """Hand a batch's token deltas (Delivery) to the detokenizer thread; they reach
        their streams, with text, in order."""
        if self._detok is None:  # no tokenizer: the front door detokenizes
            self._deliver(out, [None] * len(out))
            return
        self._detok.submit([(d[0], d[1], d[2]) for d in out],
                           lambda _items, texts: self._deliver(out, texts))

    @staticmethod
    def _deliver(out: Delivery, texts: list[str | None]) -> None:
        for (flight, ids, finished, reason, usage, lps, plps), text in zip(out, texts,
                                                                          strict=True):
            last = TokenDelta(flight.spec.request_id, (), True, reason, usage) \
                if finished else None
            flight.queue.put(ids, text, last, lps, plps)

    async def start(self) -> None:
        """Connect every worker's channel (before any request is dispatched: a leg must
        be created over the link its events come back on), then watch them all."""
        if self.router.tokenizer is not None:
            self._detok = DetokenizerThread(self.router.tokenizer, asyncio.get_running_loop())
        workers = self.router.workers
        for w, err in zip(workers, await asyncio.gather(
                *(self.liveness.connect(w) for w in workers), return_exceptions=True),
                strict=True):
            if isinstance(err, BaseException):
                log.warning("channel to %s failed: %s", w.worker_id, err)
                self.mark_dead(w)
        self._tasks += [asyncio.ensure_future(self.liveness.watch_channel(w)) for w in workers]
        self._tasks += self.upkeep.start()

    async def stop(self) -> None:
        self.stopping = True
        self.upkeep.stopping = True
        if self._detok is not None:
            self._detok.stop()
        for w in self.router.workers:
            if w.link is not None:
                w.link.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def mark_dead(self, w: WorkerHandle) -> None:
        self.liveness.mark_dead(w)

    # ---- events -----------------------------------------------------------------------
    def on_batch(self, w: WorkerHandle, load, entries: list) -> None:
        """One step message of `w`: TOKENS entries straight from the wire (the hot path),
        the rest as WorkerEvents through `_apply`."""
        if load is not None:
            w.observe_load(load)
        out: Delivery = []
        legs = self.router.legs
        now = time.monotonic()  # (the step's tokens arrived together)
        detok = self._detok
        inline = detok is not None and detok.inline and self._every_token and not self._gaps
        metrics = self.router.metrics
        for e in entries:
            try:
                if e[0] != "tokens":
                    self._apply(w, entry_event(w.worker_id, e), out)
                    continue
                flight = legs.get(e[1])
                if flight is None or flight.done or flight.leg_id != e[1]:
                    continue
                if flight.decode is not w or not flight.leg_first_seen or e[7] is not None:
                    self._apply(w, entry_event(w.worker_id, e), out)  # ignored, held, extras
                    continue
                if e[5] is not None:
                    flight.add_timing(EventKind.TOKENS, LegTiming(*e[5]))
                ids = e[2]
                if not inline or e[3] is not None or not flight.streamed or flight.unsent or not ids:
                    self._emit(w, flight, EventKind.TOKENS, ids,
                               None if e[3] is None else FINISH_OF[e[3]], out, now=now)
                    continue
                # the common token, inline: text from the byte table, straight to its stream
                flight.generated += ids
                flight.last_token_at = now
                if metrics:
                    metrics.observe_token(flight)
                if out:  # what this batch released before it goes first
                    self.deliver(out)
                    out = []
                flight.queue.put_text(ids, detok.push_now(flight, ids))
            except Exception:
                log.exception("event %s of %s from %s failed", e[0], e[1], w.worker_id)
        if out:
            self.deliver(out)

    def _apply(self, w: WorkerHandle, ev: WorkerEvent, out: Delivery) -> None:
        flight = self.router.legs.get(ev.leg_id)
        if flight is None or flight.done or flight.leg_id != ev.leg_id:
            return  # a leg that already ended
        if not _holds(w, flight, ev.kind):
            log.info("ignored %s of %s from %s: the leg is not on it", ev.kind, ev.leg_id,
                     w.worker_id)
            return
        if ev.kind == EventKind.FIRST_TOKEN:
            flight.add_timing(ev.kind, ev.timing)
            if not flight.leg_first_seen:  # (else decode's copy of it went out already)
                self._first(w, flight, ev, out)
        elif ev.kind == EventKind.PREFILL_DONE:
            flight.add_timing(ev.kind, ev.timing)
            p = flight.prefill
            if p is not None and ev.leg_id in p.legs and not flight.prefill_done:
                flight.prefill_done = True
                p.outstanding_tokens = max(0, p.outstanding_tokens - flight.leg_prompt_len)
                if p is not flight.decode:  # a colocated engine keeps the leg until it ends
                    p.legs.discard(ev.leg_id)
        elif ev.kind == EventKind.TOKENS and not flight.leg_first_seen:
            if ev.first_token is None or flight.wants_logprobs:
                flight.held_tokens.append((w, ev))  # until the prefill's first token
                return
            # decode's first step carries the first token: the prefill's message is late
            self._first(w, flight, WorkerEvent(EventKind.FIRST_TOKEN, ev.leg_id, w.worker_id,
                                               (ev.first_token,)), out)
            self._apply(w, ev, out)  # the step's own token follows it
        elif ev.kind == EventKind.TOKENS:
            flight.add_timing(ev.kind, ev.timing)
            self._emit(w, flight, ev.kind, ev.token_ids, ev.finish_reason, out, ev.logprobs)
        elif ev.kind in (EventKind.PREEMPTED, EventKind.FAILED):
            # a preempted leg that streamed its first token made progress: not a failure
            progressed = ev.kind == EventKind.PREEMPTED and flight.leg_first_seen
            self.redispatch(flight, f"{ev.kind} on {ev.worker_id}: {ev.message}",
                            failed=not progressed, ended=(w,))  # w let go of it itself

    def _first(self, w: WorkerHandle, flight: Flight, ev: WorkerEvent, out: Delivery) -> None:
        """Stream the leg's first token (the prefill's FIRST_TOKEN, or decode's copy of
        it when that comes first), then the decode tokens held until it came, in order."""
        if flight.first_token_at is None:
            flight.first_token_at = time.monotonic()
            if self.router.metrics:
                self.router.metrics.observe_ttft(flight.first_token_at - flight.arrival)
        flight.leg_first_seen = True
        self._emit(w, flight, EventKind.FIRST_TOKEN, ev.token_ids, ev.finish_reason, out,
                   ev.logprobs, ev.prompt_logprobs)
        # decode tokens that overtook the first token (they come over another worker's
        # channel) follow it now, in order; the copy of it that one of them carries is dropped
        held, flight.held_tokens = flight.held_tokens, []
        for src, later in held:
            if not flight.done:
                self._apply(src, later, out)

    def _emit(self, w: WorkerHandle, flight: Flight, kind: EventKind, token_ids,
              finish_reason, out: Delivery, logprobs=None, prompt_logprobs=None,
              now: float | None = None) -> None:
        flight.generated.extend(token_ids)
        now = time.monotonic() if now is None else now
        if (self._gaps and kind == EventKind.TOKENS
                and flight.last_token_at is not None):  # read (and trimmed) only then
            self.upkeep.gaps.append((now, now - flight.last_token_at))
        flight.last_token_at = now
        if self.router.metrics and flight.generated and kind == EventKind.TOKENS:
            self.router.metrics.observe_token(flight)
        finished = finish_reason is not None
        if (not finished and self._every_token and flight.streamed and logprobs is None
                and prompt_logprobs is None and not flight.unsent):  # the common token
            out.append((flight, token_ids, False, None, None, None, None))
            return
        usage = None
        if finished:
            self.router.release(flight)
            # The worker that finished the request ended its part itself, and so did the
            # prefill of a leg that decode finished (decode ran on all of its KV): only a
            # decode reservation left by a request that ended at its first token is aborted.
            ended = (w,) if kind == EventKind.FIRST_TOKEN else (w, flight.prefill)
            self.router.end_leg(flight, ended=ended)
            usage = flight.usage()
            if self.router.metrics:
                self.router.metrics.observe_finish(usage, flight.spec.tenant)
        flight.unsent.extend(token_ids)
        if logprobs is not None:
            flight.unsent_logprobs.extend(logprobs)
        if prompt_logprobs is not None:
            flight.unsent_prompt_logprobs = prompt_logprobs
        if (finished or not flight.streamed
                or len(flight.unsent) >= self._interval):
            flight.streamed = True
            out.append((flight, flight.unsent, finished,
                        finish_reason.value if finished else None, usage,
                        tuple(flight.unsent_logprobs) if flight.unsent_logprobs else None,
                        flight.unsent_prompt_logprobs))
            flight.unsent, flight.unsent_prompt_logprobs = [], None
            if flight.unsent_logprobs:
                flight.unsent_logprobs = []

    def redispatch(self, flight: Flight, why: str, *, failed: bool,
                   ended: tuple[WorkerHandle, ...] = ()) -> None:
        """End the flight's leg now and start the next one in its own task."""
        if failed:
            flight.failures += 1
        else:
            flight.preemptions += 1
        self.router.end_leg(flight, ended=ended)
        self.router.spawn(self._redispatch(flight, why))

    async def _redispatch(self, flight: Flight, why: str) -> None:
        log.info("re-dispatching %s: %s", flight.spec.request_id, why)
        try:
            await self.router.dispatch(flight)
        except RouterError as e:
            self.router.fail(flight, RouterError(e.code, f"{e.message} (after: {why})"))
        except Exception as e:
            self.router.fail(flight, RouterError(ErrorCode.UNAVAILABLE, f"{why}: {e}"))


def _holds(w: WorkerHandle, flight: Flight, kind: EventKind) -> bool:
    """Does `w` hold the flight's current leg in the role that reports `kind`?"""
    if kind in (EventKind.FIRST_TOKEN, EventKind.PREFILL_DONE):
        return w is flight.prefill
    if kind in (EventKind.TOKENS, EventKind.PREEMPTED):
        return w is flight.decode
    return w is flight.prefill or w is flight.decode
