"""Upkeep: the event pump's periodic work and gathering: decode pressure (ITL p90 over
the target) fed to the prefill chunk policy, KV-wait keepalives for legs whose prefill
is still on, and every worker's stats and trace events on demand."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

from cluster.router.flight import RouterCore
from cluster.router.pool import WorkerHandle
from cluster.router.types import WorkerStats
from engine.quantiles import percentile

PRESSURE_WINDOW_S = 2.0
PRESSURE_PERIOD_S = 0.5


class Upkeep:
    def __init__(self, router: RouterCore):
        self.router = router
        self.stopping = False
        self.gaps: deque[tuple[float, float]] = deque()  # (time, inter-token gap)

    def start(self) -> list[asyncio.Task]:
        tasks = [asyncio.ensure_future(self._keepalive_loop())]
        if self.router.config.adaptive_chunks:
            tasks.append(asyncio.ensure_future(self._pressure_loop()))
        return tasks

    # ---- adaptive chunking: decode ITL -> prefill chunk cap ----------------------------
    def decode_pressure(self, now: float) -> float:
        """ITL p90 of the last window over the target (>= 1: decodes are being hurt)."""
        while self.gaps and self.gaps[0][0] < now - PRESSURE_WINDOW_S:
            self.gaps.popleft()
        if not self.gaps:
            return 0.0
        return percentile([g for _, g in self.gaps], 90) / self.router.config.itl_target_s

    async def _pressure_loop(self) -> None:
        while not self.stopping:
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
        while not self.stopping:
            await asyncio.sleep(self.router.config.kv_keepalive_s)
            for d, legs in self.waiting_on_prefill().values():
                with contextlib.suppress(Exception):
                    d.actor.keepalive.remote(legs)

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
