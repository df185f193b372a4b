"""EventPump: long-polls every worker, applies its events to the router's flights, and
watches liveness (a dead actor's legs are re-dispatched; a restarted one is re-adopted).

A worker's pump never waits on another request: a re-dispatch (which may queue for
decode admission) runs as its own task, so one preemption cannot delay the tokens of
every other stream of that worker. An event counts only when it comes from the worker
that holds the leg in that role (a late reservation elsewhere cannot touch it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from cluster.flight import Flight, RouterCore
from cluster.pool import WorkerHandle
from cluster.types import ErrorCode, RouterError, TokenDelta, WorkerStats
from engine.quantiles import percentile
from runtime.messages import EventKind, WorkerEvent

log = logging.getLogger(__name__)
POLL_TIMEOUT_S = 0.05
PRESSURE_WINDOW_S = 2.0
PRESSURE_PERIOD_S = 0.5
REVIVE_INTERVAL_S = 0.5


class EventPump:
    def __init__(self, router: RouterCore):
        self.router = router
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._gaps: deque[tuple[float, float]] = deque()  # (time, inter-token gap)

    def start(self) -> None:
        for w in self.router.workers:
            self._tasks.append(asyncio.ensure_future(self._pump(w)))
        if self.router.config.adaptive_chunks:
            self._tasks.append(asyncio.ensure_future(self._pressure_loop()))
        self._tasks.append(asyncio.ensure_future(self._keepalive_loop()))

    # ---- adaptive chunking: decode ITL -> prefill chunk cap ----------------------------
    def decode_pressure(self, now: float) -> float:
        """ITL p90 of the last window over the target (>= 1: decodes are being hurt)."""
        while self._gaps and self._gaps[0][0] < now - PRESSURE_WINDOW_S:
            self._gaps.popleft()
        if not self._gaps:
            return 0.0
        return percentile([g for _, g in self._gaps], 90) / self.router.config.itl_target_s

    async def _pressure_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(PRESSURE_PERIOD_S)
            pressure = self.decode_pressure(time.monotonic())
            for w in self.router.prefill:
                if w.alive:
                    with contextlib.suppress(Exception):
                        w.actor.set_decode_pressure.remote(pressure)

    # ---- KV-wait keepalive ----------------------------------------------------------------
    def waiting_on_prefill(self) -> dict[int, tuple[WorkerHandle, list[str]]]:
        """Per decode worker, the legs whose prefill is queued or running on a live worker."""
        out: dict[int, tuple[WorkerHandle, list[str]]] = {}
        for leg_id, f in self.router.legs.items():
            p, d = f.prefill, f.decode
            if (f.done or f.prefill_done or p is None or d is None or p is d or not p.alive
                    or not d.alive or leg_id != f.leg_id):
                continue
            out.setdefault(id(d), (d, []))[1].append(leg_id)
        return out

    async def _keepalive_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.router.config.kv_keepalive_s)
            for d, legs in self.waiting_on_prefill().values():
                with contextlib.suppress(Exception):
                    d.actor.keepalive.remote(legs)

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # ---- liveness -----------------------------------------------------------------------
    def mark_dead(self, w: WorkerHandle) -> None:
        if not w.alive:
            return
        w.alive = False
        w.outstanding_tokens = 0
        log.warning("worker %s is dead; re-dispatching %d legs", w.worker_id, len(w.legs))
        for leg_id in list(w.legs):
            flight = self.router.legs.get(leg_id)
            w.legs.discard(leg_id)
            if flight is not None and not flight.done and flight.leg_id == leg_id:
                self.redispatch(flight, f"worker {w.worker_id} died", failed=True)

    async def _revive(self, w: WorkerHandle) -> None:
        """Wait until Ray restarts the actor (max_restarts), then adopt it again."""
        while not self._stopping:
            try:
                info = await asyncio.wait_for(w.actor.ready.remote(), timeout=30)
            except Exception:
                await asyncio.sleep(REVIVE_INTERVAL_S)
                continue
            w.refresh(info)
            w.restarts += 1
            w.stats = None
            w.alive = True
            log.warning("worker %s is back (restart %d)", w.worker_id, w.restarts)
            self.router.wake_admission()
            return

    async def _pump(self, w: WorkerHandle) -> None:
        while not self._stopping:
            if not w.alive:
                await self._revive(w)
                continue
            try:
                events = await w.actor.poll.remote(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("poll of %s failed: %s", w.worker_id, e)
                self.mark_dead(w)
                continue
            for ev in events:
                try:
                    await self._apply(w, ev)
                except Exception:
                    log.exception("event %s of %s failed", ev.kind, ev.leg_id)

    # ---- events -----------------------------------------------------------------------
    async def _apply(self, w: WorkerHandle, ev: WorkerEvent) -> None:
        flight = self.router.legs.get(ev.leg_id)
        if flight is None or flight.done or flight.leg_id != ev.leg_id:
            return  # a leg that already ended
        if not _holds(w, flight, ev.kind):
            log.info("ignored %s of %s from %s: the leg is not on it", ev.kind, ev.leg_id,
                     w.worker_id)
            return
        if ev.kind == EventKind.FIRST_TOKEN:
            flight.add_timing(ev.kind, ev.timing)
            if flight.first_token_at is None:
                flight.first_token_at = time.monotonic()
                if self.router.metrics:
                    self.router.metrics.observe_ttft(flight.first_token_at - flight.arrival)
            flight.leg_first_seen = True
            self._emit(w, flight, ev)
            # decode tokens that overtook the first token (they come from another worker's
            # pump) follow it now, in order
            held, flight.held_tokens = flight.held_tokens, []
            for src, later in held:
                if not flight.done:
                    await self._apply(src, later)
        elif ev.kind == EventKind.PREFILL_DONE:
            flight.add_timing(ev.kind, ev.timing)
            p = flight.prefill
            if p is not None and ev.leg_id in p.legs and not flight.prefill_done:
                flight.prefill_done = True
                p.outstanding_tokens = max(0, p.outstanding_tokens - flight.leg_prompt_len)
                if p is not flight.decode:  # a colocated engine keeps the leg until it ends
                    p.legs.discard(ev.leg_id)
        elif ev.kind == EventKind.TOKENS and not flight.leg_first_seen:
            flight.held_tokens.append((w, ev))  # the prefill's first token has not arrived
        elif ev.kind == EventKind.TOKENS:
            flight.add_timing(ev.kind, ev.timing)
            self._emit(w, flight, ev)
        elif ev.kind in (EventKind.PREEMPTED, EventKind.FAILED):
            # a preempted leg that streamed its first token made progress: not a failure
            progressed = ev.kind == EventKind.PREEMPTED and flight.leg_first_seen
            self.redispatch(flight, f"{ev.kind} on {ev.worker_id}: {ev.message}",
                            failed=not progressed, ended=(w,))  # w let go of it itself

    def _emit(self, w: WorkerHandle, flight: Flight, ev: WorkerEvent) -> None:
        flight.generated.extend(ev.token_ids)
        now = time.monotonic()
        if ev.kind == EventKind.TOKENS and flight.last_token_at is not None:
            self._gaps.append((now, now - flight.last_token_at))
        flight.last_token_at = now
        if self.router.metrics and flight.generated and ev.kind == EventKind.TOKENS:
            self.router.metrics.observe_token(flight)
        finished = ev.finished
        usage = None
        if finished:
            self.router.release(flight)
            # The worker that finished the request ended its part itself, and so did the
            # prefill of a leg that decode finished (decode ran on all of its KV): only a
            # decode reservation left by a request that ended at its first token is aborted.
            ended = (w,) if ev.kind == EventKind.FIRST_TOKEN else (w, flight.prefill)
            self.router.end_leg(flight, ended=ended)
            usage = flight.usage()
            if self.router.metrics:
                self.router.metrics.observe_finish(usage)
        flight.queue.put_nowait(TokenDelta(
            flight.spec.request_id, tuple(ev.token_ids), finished,
            ev.finish_reason.value if finished else None, usage))

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

    # ---- stats ------------------------------------------------------------------------
    async def collect_stats(self) -> list[WorkerStats]:
        async def one(w: WorkerHandle) -> WorkerStats:
            if w.alive:
                try:
                    w.stats = await asyncio.wait_for(w.actor.stats.remote(), timeout=5)
                except Exception:
                    w.stats = None
            return w.to_stats()

        return list(await asyncio.gather(*(one(w) for w in self.router.workers)))

    async def collect_traces(self) -> list[dict]:
        async def one(w: WorkerHandle) -> list[dict]:
            try:
                return await w.actor.drain_trace.remote()
            except Exception:
                return []

        batches = await asyncio.gather(*(one(w) for w in self.router.workers if w.alive))
        return [e for batch in batches for e in batch]

def _holds(w: WorkerHandle, flight: Flight, kind: EventKind) -> bool:
    """Does `w` hold the flight's current leg in the role that reports `kind`?"""
    if kind in (EventKind.FIRST_TOKEN, EventKind.PREFILL_DONE):
        return w is flight.prefill
    if kind in (EventKind.TOKENS, EventKind.PREEMPTED):
        return w is flight.decode
    return w is flight.prefill or w is flight.decode
