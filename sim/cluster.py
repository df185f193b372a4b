"""Simulation: an xPyD cluster of simulated workers, links and a router on one event loop.

    sim = Simulation(cfg, costs, SimOptions())
    result = sim.run(build_workload(spec))   # sim/results.py SimResult
    print(result.metrics().format())

The configuration is a ServeConfig (pools, cache, scheduler, transfer, limits), sized
as the launcher sizes real workers; the model shape, dtype and hardware come from the
calibration. Nothing here reads the wall clock except to report how fast it ran.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from engine.costs.model import CostModel, Limits
from sim.adapters import ServeConfig, plan_workers
from sim.decode import SimDecode
from sim.link import SimLink
from sim.loop import EventLoop
from sim.options import SimOptions
from sim.prefill import SimPrefill
from sim.results import SimResult
from sim.router import SimRouter
from sim.router_upkeep import PRESSURE_PERIOD_S
from sim.trace import SimTracer


class Simulation:
    def __init__(self, cfg: ServeConfig, costs: CostModel, options: SimOptions | None = None):
        self.cfg, self.costs = cfg, costs
        self.options = options = options or SimOptions()
        cal = costs.calibration
        shape, dtype = cal.get("model"), cal.get("dtype")
        gpu = _gpu_memory(cal)
        self.plan = plan_workers(cfg, shape, dtype, gpu)
        s = cfg.scheduler
        link = options.interconnect or cfg.transfer.connector
        costs.check_covers(Limits(s.max_num_batched_tokens, s.max_num_seqs, s.max_num_seqs,
                                  self.plan.max_model_len, link))
        self.link_cost = costs.link(link)
        self.rpc_s, self.client_s = costs.rpc_s, costs.client_s
        self.idle_wait_s = costs.idle_wait_s
        self.delivery = costs.delivery
        self.loop = EventLoop()
        # A message between router and worker: ``emit(fn, *args)`` delivers it ``rpc_s``
        # from now (``loop.after`` bound to ``rpc_s``: no frame of its own).
        self.emit: Callable[..., None] = partial(self.loop.after, self.rpc_s)
        self.tracer = SimTracer() if options.trace else None
        # the router's own choice (RouterConfig.make_placement), or the one asked for
        router = replace(self.plan.router, length_buckets=tuple(options.length_buckets),
                         placement=options.placement or self.plan.router.placement)
        self.placement = router.make_placement()
        self.prefill = [SimPrefill(self, f"prefill-{i}") for i in range(cfg.pools.prefill_workers)]
        self.decode = [SimDecode(self, f"decode-{i}") for i in range(cfg.pools.decode_workers)]
        self.prefill_by_id = {w.worker_id: w for w in self.prefill}
        self.decode_by_id = {w.worker_id: w for w in self.decode}  # (a KV sender's dest)
        self.links: list[SimLink] = []
        self.router = SimRouter(self)
        self.arrivals_left = 0
        self._inflight = 0
        self._held: deque = deque()

    def make_link(self, src: SimPrefill, dst: SimDecode) -> SimLink:
        link = SimLink(self, src, dst)
        self.links.append(link)
        return link

    def _arrive(self, requests: Sequence, i: int) -> None:
        """The client's turn to send request i (bench: it waits while ``max_concurrency``
        requests are in flight, and its send time is when it is actually sent)."""
        if i + 1 < len(requests):
            self.loop.at(requests[i + 1].arrival_s, self._arrive, requests, i + 1)
        cap = self.options.max_concurrency
        if cap is not None and self._inflight >= cap:
            self._held.append(requests[i])
            return
        self._send(requests[i])

    def _send(self, req) -> None:
        self._inflight += 1
        self.arrivals_left -= 1
        if self.client_s:
            self.loop.at(self.loop.now + self.client_s, self.router.arrive, req, self.loop.now)
        else:  # an in-process client: the router has it now
            self.router.arrive(req, self.loop.now)

    def client_done(self) -> None:
        """A request's last word reached the client: a held request may go."""
        self._inflight -= 1
        if self._held:
            self._send(self._held.popleft())

    def run(self, requests: Sequence) -> SimResult:
        """Simulate the workload (``bench.workload.WorkloadRequest``s) to the end."""
        if not requests:
            raise ValueError("the workload has no requests")
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        self.arrivals_left = len(reqs)
        wall0 = time.perf_counter()
        self.loop.at(reqs[0].arrival_s, self._arrive, reqs, 0)
        refresh = self.options.stats_refresh_s
        if refresh is None and self.cfg.server.metrics_port is not None:
            refresh = 1.0  # cluster/metrics.py refresh_loop
        if refresh is not None:
            self.loop.at(refresh, self.router.refresh_stats, refresh)
        self.loop.at(self.plan.router.kv_keepalive_s, self.router.keepalive_loop)
        if self.plan.router.adaptive_chunks:
            self.loop.at(PRESSURE_PERIOD_S, self.router.pressure_loop)
        # Every object of a run dies by its reference count (it makes no cyclic garbage):
        # the collector would only walk the growing heap (~5% of a 1-hour run's CPU).
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.loop.run()
        finally:
            if collecting:
                gc.enable()
        wall = time.perf_counter() - wall0
        stuck = [f.req.request_id for f in self.router.flights.values()]
        if stuck:
            raise AssertionError(f"simulation ended with {len(stuck)} requests in flight "
                                 f"(e.g. {stuck[:3]}): a lost event")
        return SimResult(self, reqs, wall)


    def check_quiescent(self) -> None:
        """After a run: nothing held anywhere (the leak check of every lifecycle test)."""
        problems = []
        for w in self.prefill:
            e = w.engine
            if e.has_work or e.kv_in_flight or w.bm.num_used_blocks:
                problems.append(f"{w.worker_id}: {len(e.jobs)} jobs, {e.kv_in_flight} legs' "
                                f"KV in flight, {w.bm.num_used_blocks} blocks in use")
        for d in self.decode:
            if d.has_work or d.bm.num_used_blocks or d.sched.promises or d.early or d.inbox:
                problems.append(f"{d.worker_id}: {len(d.sched.pending)} pending, "
                                f"{len(d.sched.running)} running, {d.bm.num_used_blocks} blocks, "
                                f"{len(d.early)} legs' early KV held")
        for bm in [w.bm for w in self.prefill] + [d.bm for d in self.decode]:
            bm.check_integrity()
        for link in self.links:
            if link.sched.has_pending or link.sched.inflight_bytes or link._outstanding:
                problems.append(f"{link.name}: frames still queued or unacked")
        r = self.router
        if r.flights or r.legs or any(r.outstanding.values()) or any(r.held.values()):
            problems.append("router: legs or outstanding tokens left")
        if len(r.admission) or r.admission.core.busy or r.reserving:
            problems.append("router: decode admission still has waiters or reserves")
        if problems:
            raise AssertionError("simulation left state behind: " + "; ".join(problems))


def _gpu_memory(cal) -> float | None:
    """Device memory for KV sizing: an analytic profile's HBM, a measured GPU's memory,
    or None (a CPU: kv_cache_memory_gb)."""
    if cal.kind == "analytic":
        return cal.number("profile.hbm_bytes", minimum=1)
    if str(cal.get("hardware.device")).startswith("cuda"):
        return cal.number("hardware.memory_bytes", minimum=1)
    return None


def simulate_config(cfg: ServeConfig, requests: Sequence, costs: CostModel,
                    options: SimOptions | None = None):
    """Run one study configuration in the simulator; returns the record a real run gives
    (bench/studies/service.py RunOutput: records, trace events, per-worker step stats),
    so a study can swap the service for the simulator (`pdserve study --simulate`)."""
    sim = Simulation(cfg, costs, options)
    out = sim.run(requests).run_output()
    sim.check_quiescent()
    return out
