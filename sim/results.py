"""What a simulated run produced: per-request timelines (what a client would have seen),
the bench metrics, worker statistics, trace events, and the record a real study run gives.

A client sees a prefill's first token ``delivery.first_token_s + client_s`` after the
step that sampled it and each decode token when the control plane delivers its step's
events (engine/costs/delivery.py: ``token_s`` after the step, coalesced with later steps while the
path is busy) plus ``client_s``; a decode leg's tokens are the contiguous steps of its
worker from its first one (``SimDecode.step_times``); that first step also carries the
leg's first token, which reaches the client by whichever copy comes first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.metrics import BenchmarkMetrics, compute_metrics
from bench.records import PHASES, RequestRecord
from sim.metrics import Timelines, fast_metrics

if TYPE_CHECKING:
    from sim.cluster import Simulation
    from sim.router import Flight


class SimResult:
    def __init__(self, sim: Simulation, requests: Sequence, wall_s: float):
        self.label = sim.costs.label
        self.calibration = sim.costs.calibration.header()
        self.options = sim.options
        self.wall_s = wall_s
        self.events_run = sim.loop.events_run
        self.sim_end_s = sim.router.last_end
        self.requests = requests
        self.rejected = sim.router.rejected
        by_id = {f.req.request_id: f for f in sim.router.finished}
        self.flights: list[Flight] = [by_id[r.request_id] for r in requests]
        self._client_s = sim.client_s
        self._stream_interval = sim.plan.router.stream_interval
        self._delivery = d = sim.delivery
        steps = {w.worker_id: np.frombuffer(w.step_times, dtype=float) for w in sim.decode}
        # per worker: when each step's tokens reach the client (one path per worker, or one
        # for the whole router), or the step ends themselves (one path per stream:
        # delivered per leg below)
        if d.scope == "router" and steps:
            ends = np.concatenate(list(steps.values()))
            order = np.argsort(ends, kind="stable")
            got = np.empty_like(ends)
            got[order] = d.arrivals(ends[order])
            cuts = np.cumsum([len(t) for t in steps.values()])[:-1]
            steps = dict(zip(steps, np.split(got, cuts), strict=True))
        elif d.scope == "worker":
            steps = {w: d.arrivals(t) for w, t in steps.items()}
        self._per_step = d.scope != "request"
        self._steps = {w: t + sim.client_s for w, t in steps.items()}
        self.worker_stats = {w.worker_id: w.stats() for w in sim.prefill + sim.decode}
        for link in sim.links:
            self.worker_stats[link.src.worker_id].setdefault("links", {})[link.dst.worker_id] = {
                "bytes_sent": link.bytes_sent, "frames_sent": link.frames_sent,
                "peak_inflight_bytes": link.sched.peak_inflight_bytes}
        self.events = sim.tracer.events() if sim.tracer is not None else []

    @property
    def simulated_s(self) -> float:
        """Simulated time from the first arrival to the end of the last request."""
        return self.sim_end_s - self.requests[0].arrival_s

    @property
    def speedup(self) -> float:
        """Simulated seconds per wall-clock second."""
        return self.simulated_s / self.wall_s if self.wall_s > 0 else float("inf")

    def token_times(self, f: Flight) -> np.ndarray:
        """The times a client received ``f``'s tokens (empty for a failed request)."""
        if f.error:
            return np.empty(0)
        parts: list = []
        for item in f.tokens:
            if isinstance(item, tuple):
                w, first, count, seen = item
                t = self._steps[w.worker_id][first:first + count]
                t = t if self._per_step else self._delivery.arrivals(t)
                # the leg's first step carries its first token: the router streams the
                # prefill's copy or this one, whichever comes first (cluster/router/events.py)
                if seen:  # the prefill's copy is the part before
                    parts[-1] = np.minimum(parts[-1], t[:1])
                else:
                    parts.append(t[:1])
                parts.append(t)
            else:
                parts.append(np.array([item + self._client_s]))
        if not parts:
            return np.empty(0)
        # tokens of an earlier leg's late message follow in order
        t = np.maximum.accumulate(np.concatenate(parts))
        k = self._stream_interval
        if k > 1 and len(t) > 2:  # after the first, tokens go out k at a time (and the last)
            j = np.arange(1, len(t))
            t[1:] = t[np.minimum(-(-j // k) * k, len(t) - 1)]
        return t

    def _phases(self, f: Flight) -> dict[str, float | None]:
        if f.error or not f.finish_reason:
            return {f"{p}_s": None for p in PHASES}
        return {f"{p}_s": float(f.timing.get(f"{p}_s", 0.0)) for p in PHASES}

    def records(self) -> list[RequestRecord]:
        """bench.records.RequestRecord per request, in workload order."""
        out = []
        for f in self.flights:
            t = self.token_times(f).tolist()
            r = f.req
            out.append(RequestRecord(
                r.request_id, r.prompt_len, f.send_s, tuple(t),
                end_time=t[-1] if t else None, tenant=r.tenant, kind=r.kind,
                success=not f.error, finish_reason=f.finish_reason, error=f.error,
                **self._phases(f)))
        return out

    def timelines(self) -> Timelines:
        n = len(self.flights)
        first, end = np.full(n, np.nan), np.full(n, np.nan)
        n_out = np.zeros(n, dtype=np.int64)
        phases = {p: np.full(n, np.nan) for p in PHASES}
        itls = []
        for i, f in enumerate(self.flights):
            t = self.token_times(f)
            if len(t):
                first[i], end[i], n_out[i] = t[0], t[-1], len(t)
                if not f.error:
                    itls.append(np.diff(t))
            for p, v in self._phases(f).items():
                if v is not None:
                    phases[p[:-2]][i] = v
        return Timelines(
            send=np.array([f.send_s for f in self.flights], dtype=float),
            first=first, end=end, n_out=n_out,
            prompt_len=np.array([r.prompt_len for r in self.requests], dtype=np.int64),
            success=np.array([not f.error for f in self.flights], dtype=bool),
            tenant=[r.tenant for r in self.requests],
            itl=np.concatenate(itls) if itls else np.empty(0), phases=phases)

    def metrics(self, *, slos: Mapping[str, float] | None = None,
                long_prompt_threshold: int | None = 1024,
                tenant_weights: Mapping[str, float] | None = None,
                exact: bool | None = None) -> BenchmarkMetrics:
        """The bench's metrics. ``exact``: through bench.metrics.compute_metrics over
        RequestRecords (default for up to 1M tokens), else the array path (same numbers)."""
        if exact is None:
            exact = sum(f.generated for f in self.flights) <= 1_000_000
        kw = {"slos": slos, "long_prompt_threshold": long_prompt_threshold,
              "tenant_weights": tenant_weights}
        if exact:
            return compute_metrics(self.records(), **kw)
        return fast_metrics(self.timelines(), **kw)

    def summary(self) -> dict[str, Any]:
        """The simulation's own figures (for the JSON and the console)."""
        return {"label": self.label, "calibration": self.calibration,
                "options": {k: v for k, v in vars(self.options).items() if k != "extra"},
                "simulated_s": self.simulated_s, "wall_s": self.wall_s,
                "speedup_vs_real_time": self.speedup, "events": self.events_run,
                "rejected": self.rejected,
                "preemptions": sum(f.preemptions for f in self.flights)}

    def run_output(self):
        """The record a real study run gives (bench/studies/service.py RunOutput)."""
        from bench.studies.service import RunOutput

        stats = {w: {"role": s["role"], "steps": s["steps"], "mean_step_s": s["mean_step_s"],
                     "kv_bytes_sent": s["kv_bytes_sent"]} for w, s in self.worker_stats.items()}
        return RunOutput(self.records(), list(self.events), stats, wall_offset=0.0)
