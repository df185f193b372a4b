"""A launched configuration: Ray workers + Router + gRPC server, and a pool that reuses them.

Every configuration of a study is a real service: the launcher starts its worker actors
on the (shared) local Ray, the Router runs on the event loop of a ``BackgroundServer``
that also serves gRPC on an ephemeral port. A workload reaches it either in-process
(``bench.router_driver`` on the server's loop) or over gRPC (``bench.client`` from the
caller's thread): the same records either way.

Starting a configuration costs 20-60 s on a 2-core box (worker processes import torch
and load the model), so :class:`ServicePool` keeps one configuration ``pinned`` (the
studies' shared default) alive beside the current one and reuses any live service whose
configuration is identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from bench.records import RequestRecord
from bench.workload import WorkloadRequest
from cluster.config.serve import ServeConfig
from engine.tracing import TraceEvent, events_from_dicts
from runtime.gc_pauses import settle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """``disagg``: P/D pools of the config; ``colocated``: ``engines`` colocated engines."""

    kind: str = "disagg"
    engines: int = 2
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("disagg", "colocated"):
            raise ValueError(f"Layout.kind must be 'disagg' or 'colocated', got {self.kind!r}")


DISAGG = Layout()
OnDone = Callable[[RequestRecord], None]
# send(requests, on_done=None): each request at its arrival offset from this call's start
Sender = Callable[..., Awaitable[list[RequestRecord]]]


@dataclass(frozen=True)
class Drive:
    """A workload that decides as it runs what to send (e.g. long prompts until other
    requests end): ``run(send, on_done)`` returns every record; ``total`` is what a
    progress bar counts."""

    total: int
    run: Callable[[Sender, OnDone | None], Awaitable[list[RequestRecord]]]

    @classmethod
    def of(cls, requests: Sequence[WorkloadRequest]) -> Drive:
        """A fixed workload: every request at its arrival offset."""
        return cls(len(requests), lambda send, on_done: send(requests, on_done))


def build_router(cfg: ServeConfig, layout: Layout = DISAGG, *, trace: bool = False):
    """Start ``layout``'s workers for ``cfg`` on Ray; returns the Router in front of them."""
    from cluster.launch.launcher import (
        LaunchOptions,
        build_colocated_pool_router,
        build_disaggregated_router,
    )

    opts = LaunchOptions(trace=trace)
    if layout.kind == "disagg":
        return build_disaggregated_router(cfg, opts)
    return build_colocated_pool_router(cfg, layout.engines, layout.chunked_prefill, opts)


def ensure_ray(num_cpus: int = 4) -> bool:
    """Start a local Ray (``num_cpus`` logical CPUs, so 2 services of 1P+1D fit on a 2-core
    box) unless one is running; returns True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=max(num_cpus, os.cpu_count() or 1), num_gpus=0, include_dashboard=False,
             namespace="pdserve-bench", configure_logging=False, log_to_driver=False)
    return True


@dataclass
class RunOutput:
    """What one workload run on one service produced."""

    records: list[RequestRecord]
    events: list[TraceEvent]
    worker_stats: dict[str, dict[str, float]] = field(default_factory=dict)  # per-run deltas
    wall_offset: float = 0.0  # time.time() - time.monotonic(): record times -> trace times
    # tenant -> prompt tokens admitted to decode while another tenant waited, in this run
    admission_tokens: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """As ``cluster.serve.server.serve`` after startup, for the length of a run: what this process
    holds now (torch, the model's config, earlier runs' traces) goes off the collector, so
    a full collection during the run walks the run's own objects only. The router runs in
    this process here, and a full collection pauses it: 7 runs of one workload holding
    ~400k tracked objects gave TTFT p50 20.6-33.7 ms, frozen 17.2-25.0 ms."""
    settle()
    try:
        yield
    finally:
        gc.unfreeze()  # the process's own objects are the collector's again


class Service:
    """One configuration, started; ``close()`` stops the gRPC server, router and actors."""

    def __init__(self, cfg: ServeConfig, layout: Layout = DISAGG, *, trace: bool = True):
        from cluster.serve.server import BackgroundServer

        self.cfg = cfg.with_values({"server.port": 0, "limits.drain_timeout_s": 0.0})
        self.layout = layout
        t0 = time.monotonic()
        self.router = build_router(self.cfg, layout, trace=trace)
        self.server = BackgroundServer(self.router, self.cfg, health_poll_s=0.5)
        self.address = self.server.start()
        self.startup_s = time.monotonic() - t0
        log.info("service %s up on %s in %.1fs", layout, self.address, self.startup_s)

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the service's event loop (where the router lives)."""
        return self.server.run(coro, timeout)

    def drain_events(self) -> list[TraceEvent]:
        drain = getattr(self.router, "drain_traces", None)
        return events_from_dicts(self.run(drain(), 60)) if drain else []

    def worker_stats(self) -> dict[str, dict[str, float]]:
        stats = self.run(self.router.stats(), 60)
        return {w.worker_id: {"role": w.role, **w.extra} for w in stats.workers}

    def admission_tokens(self) -> dict[str, int]:
        """The router's contended decode admissions per tenant so far (ClusterStats)."""
        stats = self.run(self.router.stats(), 60)
        return dict(stats.admission_contended_tokens)

    def run_workload(self, work: Sequence[WorkloadRequest] | Drive, *,
                     transport: str = "inproc", max_concurrency: int | None = None,
                     on_done: OnDone | None = None, timeout: float = 1800.0) -> RunOutput:
        """Send ``work`` (a workload, or a :class:`Drive` that decides as it runs) in-process
        or over gRPC and collect records, this run's trace events and per-worker step
        statistics. The run holds this process's earlier objects off the collector
        (``heap_frozen``), as the served front door holds its startup's."""
        drive = work if isinstance(work, Drive) else Drive.of(work)
        self.drain_events()  # leftovers of an earlier run on this service
        admitted = self.admission_tokens()
        with heap_frozen():
            records, before, after = self._run(drive, transport, max_concurrency, on_done,
                                               timeout)
        tokens = {t: n - admitted.get(t, 0) for t, n in self.admission_tokens().items()
                  if n > admitted.get(t, 0)}
        return RunOutput(records, self.drain_events(), stats_delta(before, after),
                         wall_offset=time.time() - time.monotonic(), admission_tokens=tokens)

    def _run(self, drive: Drive, transport: str, max_concurrency: int | None,
             on_done: OnDone | None, timeout: float):
        from bench.router_driver import run_workload, timed_requests

        before = self.worker_stats()
        if transport == "inproc":
            async def send_inproc(reqs: Sequence[WorkloadRequest],
                                  done: OnDone | None = None) -> list[RequestRecord]:
                return await run_workload(self.router, timed_requests(reqs),
                                          max_concurrency=max_concurrency, on_done=done)

            records = self.run(drive.run(send_inproc, on_done), timeout)
        elif transport == "grpc":
            from bench.client import AsyncPdserveClient, run_requests

            async def go() -> list[RequestRecord]:
                async with AsyncPdserveClient(self.address, timeout=timeout) as client:
                    async def send_grpc(reqs: Sequence[WorkloadRequest],
                                        done: OnDone | None = None) -> list[RequestRecord]:
                        return await run_requests(client, reqs, max_concurrency=max_concurrency,
                                                  on_done=done)

                    return await drive.run(send_grpc, on_done)

            records = asyncio.run(go())
        else:
            raise ValueError(f"transport must be 'inproc' or 'grpc', got {transport!r}")
        return records, before, self.worker_stats()

    def close(self) -> None:
        server_log = logging.getLogger("cluster.serve.server")
        level = server_log.level
        server_log.setLevel(logging.ERROR)  # "health: NOT_SERVING" is expected here
        try:
            self.server.stop(drain_timeout_s=0)
        except Exception:  # a dead worker must not stop the other configurations
            log.exception("stopping service %s failed", self.layout)
        finally:
            server_log.setLevel(level)


COUNTED = ("kv_bytes_sent", "gc_collections", "gc_full_collections", "gc_pause_s")
DEVICE_COUNTED = ("device_busy_s", "device_wall_s", "host_lag_s", "host_lag_steps",
                  "process_cpu_s")


def stats_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per worker: steps taken and mean step time during the run, and what it ``COUNTED``
    (KV bytes sent, its process's garbage collections and their pause time)."""
    out = {}
    for wid, a in after.items():
        b = before.get(wid, {})
        steps = a.get("num_steps", 0) - b.get("num_steps", 0)
        busy = a.get("num_steps", 0) * a.get("mean_step_s", 0.0) - \
            b.get("num_steps", 0) * b.get("mean_step_s", 0.0)
        out[wid] = {"role": a.get("role", ""), "steps": steps,
                    "mean_step_s": busy / steps if steps > 0 else None,
                    **{k: a.get(k, 0.0) - b.get(k, 0.0) for k in COUNTED}}
        # an emulated device's accounting over the run (engine/emulate/device.py)
        dev = {k: a[k] - b.get(k, 0.0) for k in DEVICE_COUNTED if k in a}
        if dev.get("device_wall_s"):
            out[wid].update(dev, device_busy_ratio=dev["device_busy_s"] / dev["device_wall_s"])
    return out


def merge_runs(runs: Sequence[RunOutput]) -> RunOutput:
    """Runs as one, for fits over more steps: each run's request ids tagged with its index
    (runs of one workload reuse them), each worker's steps and busy time summed."""
    def tag(i: int, rid: str) -> str:
        return rid if rid == "*" else ",".join(f"{i}/{x}" for x in rid.split(","))

    records, events, stats, admitted = [], [], {}, {}
    for i, run in enumerate(runs):
        for tenant, n in run.admission_tokens.items():
            admitted[tenant] = admitted.get(tenant, 0) + n
        records += [replace(r, request_id=tag(i, r.request_id)) for r in run.records]
        events += [replace(e, request_id=tag(i, e.request_id)) for e in run.events]
        for wid, d in run.worker_stats.items():
            s = stats.setdefault(wid, {"role": d["role"], "steps": 0, "busy": 0.0,
                                       **dict.fromkeys(COUNTED, 0.0)})
            if d["mean_step_s"]:
                s["steps"] += d["steps"]
                s["busy"] += d["steps"] * d["mean_step_s"]
            for k in COUNTED:
                s[k] += d.get(k, 0.0)
    delta = {wid: {"role": s["role"], "steps": s["steps"],
                   "mean_step_s": s["busy"] / s["steps"] if s["steps"] else None,
                   **{k: s[k] for k in COUNTED}} for wid, s in stats.items()}
    return RunOutput(records, events, delta, runs[0].wall_offset if runs else 0.0, admitted)


def mean_step_s(delta: dict[str, dict], role: str) -> float | None:
    """Step-weighted mean step time of the workers of ``role`` in a stats delta."""
    steps = sum(d["steps"] for d in delta.values() if d["role"] == role and d["mean_step_s"])
    busy = sum(d["steps"] * d["mean_step_s"] for d in delta.values()
               if d["role"] == role and d["mean_step_s"])
    return busy / steps if steps else None


def device_timing(delta: dict[str, dict], role: str) -> dict[str, float] | None:
    """An emulated device's step accounting of the ``role`` workers over a run (summed over
    them; None off an emulated device): ``kernel_s``, the device's busy time per engine
    step (its KV copies included);
    ``gap_s``, the host's lag per continuing step (how long the device sat idle between a
    step and the one that needed its results: the scheduling gap); ``busy_ratio``, device
    seconds over wall seconds; ``lag_share``, the lag over the busy time."""
    ds = [d for d in delta.values() if d["role"] == role and d.get("device_wall_s")]
    if not ds:
        return None
    tot = {k: sum(d.get(k, 0.0) for d in ds) for k in DEVICE_COUNTED}
    steps = sum(d["steps"] for d in ds)
    return {"kernel_s": tot["device_busy_s"] / steps if steps else 0.0,
            "gap_s": tot["host_lag_s"] / tot["host_lag_steps"] if tot["host_lag_steps"] else 0.0,
            "busy_ratio": tot["device_busy_s"] / tot["device_wall_s"],
            "lag_share": tot["host_lag_s"] / tot["device_busy_s"] if tot["device_busy_s"] else 0.0}


def config_key(cfg: ServeConfig, layout: Layout) -> str:
    return json.dumps([cfg.to_dict(), layout.__dict__], sort_keys=True, default=str)


class ServicePool:
    """Live services by configuration: the ``pinned`` one plus at most one other."""

    def __init__(self, *, trace: bool = True):
        self.trace = trace
        self.pinned: str | None = None
        self._live: dict[str, Service] = {}
        self.launches = 0
        self.started_ray = False

    def pin(self, cfg: ServeConfig, layout: Layout = DISAGG) -> None:
        """Keep this configuration alive once started (the studies' shared default)."""
        self.pinned = config_key(cfg, layout)

    def get(self, cfg: ServeConfig, layout: Layout = DISAGG) -> Service:
        key = config_key(cfg, layout)
        if key in self._live:
            return self._live[key]
        if key != self.pinned:  # make room: the pinned service stays, the other one goes
            for other in [k for k in self._live if k != self.pinned]:
                self._live.pop(other).close()
        self.started_ray |= ensure_ray()
        self._live[key] = svc = Service(cfg, layout, trace=self.trace)
        self.launches += 1
        return svc

    def close(self) -> None:
        """Stop every live service, and Ray if this pool started it."""
        for svc in self._live.values():
            svc.close()
        self._live.clear()
        if self.started_ray:
            import ray

            ray.shutdown()
            self.started_ray = False
