"""The simulated router's periodic work (cluster/router/upkeep.py and the loops of
cluster/router/events.py on the simulated clock): KV-wait keepalives to the decode
workers, the stale KV-usage view the decode order reads, and the adaptive-chunk pressure
fed to every prefill worker. Each loop re-arms while requests are in flight or to come.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from sim.adapters import RouterConfig
from sim.loop import EventLoop

PRESSURE_WINDOW_S, PRESSURE_PERIOD_S = 2.0, 0.5  # cluster/router/events.py


class RouterUpkeep:
    """SimRouter's periodic loops (a base class: they read and set its state)."""

    # set by SimRouter.__init__ (declared here for the type checker and mypyc; the
    # Simulation and Flight as Any: naming them here would close an import cycle)
    sim: Any
    loop: EventLoop
    cfg: RouterConfig
    flights: dict[str, Any]
    legs: dict[str, Any]
    held: dict[str, set[str]]
    kv_view: dict[str, float]

    def _decode_load(self, wid: str) -> None:
        raise NotImplementedError

    # ---- periodic views ---------------------------------------------------------------
    def keepalive_loop(self) -> None:
        """cluster/router/events.py _keepalive_loop: each decode worker hears which of its
        pending legs still have their prefill queued or running."""
        by_decode: dict[str, list[str]] = {}
        for p in self.sim.prefill:
            for leg in self.held[p.worker_id]:
                f = self.legs.get(leg)
                if f is None or f.done or f.prefill_done or f.decode is None or f.prefill is not p:
                    continue
                by_decode.setdefault(f.decode.worker_id, []).append(leg)
        for d in self.sim.decode:  # in worker order: a run never depends on set order
            if d.worker_id in by_decode:
                self.sim.emit(d.command, d.keepalive, by_decode[d.worker_id])
        if self.flights or self.sim.arrivals_left:
            self.loop.at(self.loop.now + self.cfg.kv_keepalive_s, self.keepalive_loop)

    def refresh_stats(self, period: float) -> None:
        for w in self.sim.decode:
            self.kv_view[w.worker_id] = w.bm.usage
            self._decode_load(w.worker_id)
        if self.flights or self.sim.arrivals_left:
            self.loop.at(self.loop.now + period, self.refresh_stats, period)

    def pressure_loop(self) -> None:
        """cluster/router/events.py _pressure_loop: decode ITL p90 over the last window
        against the target, to every prefill worker's chunk policy."""
        now = self.loop.now
        gaps: list = []
        for w in self.sim.decode:
            t, b = w.step_times, w.step_batch
            i = bisect.bisect_left(t, now - PRESSURE_WINDOW_S)
            if len(t) - i >= 2:
                ends = np.frombuffer(t, dtype=float)[max(i - 1, 0):]
                gaps.append(np.repeat(np.diff(ends), np.frombuffer(b, dtype=np.int32)[max(i, 1):]))
        if gaps:
            g = np.sort(np.concatenate(gaps))
            pressure = float(g[int(0.9 * (len(g) - 1))]) / self.cfg.itl_target_s if len(g) else 0.0
        else:
            pressure = 0.0
        for p in self.sim.prefill:
            self.sim.emit(p.command, p.set_decode_pressure, pressure)
        if self.flights or self.sim.arrivals_left:
            self.loop.at(now + PRESSURE_PERIOD_S, self.pressure_loop)
