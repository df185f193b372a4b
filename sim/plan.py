"""`pdserve plan`: which P:D split (and prefill chunk) serves a workload best on N GPUs,
asked of the simulator, which runs the service's own policy code on a cost model.

Every candidate (x prefill + y decode workers with x + y = N, x, y >= 1; each chunk size
asked for) runs the same seeded workload; the table gives each one's SLO goodput, TTFT /
ITL / TPOT p99 and its cost in GPU-seconds per request that met the SLOs. The
recommendation is the highest goodput (ties: the lower TTFT p99, then fewer prefill
workers), and its configuration is printed as the YAML `pdserve serve --config` reads.

    plan = plan_splits(cfg, costs, opts, requests, gpus=8, slos={"ttft": 500, "tpot": 50})
    print(format_plan(plan)); print(plan.best.config.to_yaml())
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.config.serve import ServeConfig
from engine.costs.model import CostModel
from sim.cluster import Simulation
from sim.options import SimOptions


@dataclass(frozen=True)
class Candidate:
    prefill: int
    decode: int
    chunk: int

    @property
    def name(self) -> str:
        return f"{self.prefill}P{self.decode}D-c{self.chunk}"


@dataclass
class Outcome:
    candidate: Candidate
    config: ServeConfig
    goodput_rps: float
    completed: int
    failed: int
    ttft_p99_ms: float
    itl_p99_ms: float
    tpot_p99_ms: float
    gpu_s_per_good_request: float  # N GPUs x the run's duration / requests within the SLOs
    errors: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        c = self.candidate
        return {"split": f"{c.prefill}P{c.decode}D", "prefill_workers": c.prefill,
                "decode_workers": c.decode, "chunk": c.chunk, "goodput_rps": self.goodput_rps,
                "completed": self.completed, "failed": self.failed,
                "ttft_p99_ms": self.ttft_p99_ms, "itl_p99_ms": self.itl_p99_ms,
                "tpot_p99_ms": self.tpot_p99_ms,
                "gpu_s_per_good_request": self.gpu_s_per_good_request}


@dataclass
class Plan:
    gpus: int
    slos: dict[str, float]
    outcomes: list[Outcome]
    label: str  # the cost model's

    @property
    def best(self) -> Outcome:
        return min(self.outcomes, key=lambda o: (-o.goodput_rps, o.ttft_p99_ms,
                                                 o.candidate.prefill, o.candidate.chunk))


def candidates(gpus: int, chunks: Sequence[int]) -> list[Candidate]:
    """Every xPyD split of ``gpus`` workers (both pools non-empty) at each chunk size."""
    if gpus < 2:
        raise ValueError(f"--gpus must be >= 2 (one prefill and one decode worker), got {gpus}")
    if not chunks or any(c < 1 for c in chunks):
        raise ValueError(f"chunk sizes must be >= 1, got {list(chunks)}")
    return [Candidate(x, gpus - x, c) for x in range(1, gpus) for c in chunks]


def plan_splits(cfg: ServeConfig, costs: CostModel, opts: SimOptions, requests: Sequence,
                gpus: int, slos: Mapping[str, float], chunks: Sequence[int] = (),
                progress: Callable[[Candidate], None] | None = None) -> Plan:
    """Simulate every candidate on ``requests``; ``chunks`` empty: the config's chunk."""
    if not slos:
        raise ValueError("a plan needs SLOs to count goodput by (--slo ttft:MS,tpot:MS)")
    sizes = tuple(chunks) or (cfg.scheduler.max_prefill_chunk,)
    outcomes = []
    for cand in candidates(gpus, sizes):
        if progress:
            progress(cand)
        c = cfg.with_values({"pools.prefill_workers": cand.prefill,
                             "pools.decode_workers": cand.decode,
                             "scheduler.max_prefill_chunk": cand.chunk})
        result = Simulation(c, costs, opts).run(requests)
        m = result.metrics(slos=slos)
        good = m.request_goodput or 0.0
        outcomes.append(Outcome(
            cand, c, good, m.completed, m.failed, m.ttft.percentiles[99.0] * 1e3,
            m.itl.percentiles[99.0] * 1e3, m.tpot.percentiles[99.0] * 1e3,
            gpus / good if good > 0 else math.inf,
            sorted({f.error for f in result.flights if f.error})[:3]))
    return Plan(gpus, dict(slos), outcomes, costs.label)


def format_plan(plan: Plan) -> str:
    """The table of every candidate, best first marked, and the recommendation's line."""
    best = plan.best
    head = (f"{'split':<8}{'chunk':>6}{'goodput/s':>11}{'ok':>7}{'failed':>7}"
            f"{'TTFT p99':>10}{'ITL p99':>9}{'TPOT p99':>10}{'GPU-s/good':>12}")
    lines = [f"P:D splits of {plan.gpus} GPUs, SLOs {plan.slos} ms; {plan.label}", head,
             "-" * len(head)]
    for o in sorted(plan.outcomes, key=lambda o: (o.candidate.chunk, o.candidate.prefill)):
        c, mark = o.candidate, "  <- best" if o is best else ""
        cost = f"{o.gpu_s_per_good_request:.3f}" if math.isfinite(o.gpu_s_per_good_request) \
            else "inf"
        lines.append(f"{f'{c.prefill}P{c.decode}D':<8}{c.chunk:>6}{o.goodput_rps:>11.2f}"
                     f"{o.completed:>7}{o.failed:>7}{o.ttft_p99_ms:>10.1f}{o.itl_p99_ms:>9.1f}"
                     f"{o.tpot_p99_ms:>10.1f}{cost:>12}{mark}")
    runner_up = sorted(plan.outcomes, key=lambda o: -o.goodput_rps)[1:2]
    margin = ""
    if runner_up and runner_up[0].goodput_rps > 0:
        margin = (f" ({best.goodput_rps / runner_up[0].goodput_rps:.2f}x the next best, "
                  f"{runner_up[0].candidate.name})")
    lines.append(f"recommendation: {best.candidate.prefill} prefill + "
                 f"{best.candidate.decode} decode workers, chunk {best.candidate.chunk}: "
                 f"{best.goodput_rps:.2f} good requests/s{margin}")
    return "\n".join(lines)


ALWAYS = {"pools": ("prefill_workers", "decode_workers"), "scheduler": ("max_prefill_chunk",)}


def plan_yaml(plan: Plan, full: bool = False) -> str:
    """The recommended configuration as `pdserve serve --config` reads it: every key, or
    (``full`` False) the split, the chunk and whatever else differs from the defaults."""
    import yaml

    best = plan.best.config
    head = f"# pdserve plan: {plan.best.candidate.name} for SLOs {plan.slos} ms ({plan.label})\n"
    if full:
        return head + best.to_yaml()
    base, mine = ServeConfig().to_dict(), best.to_dict()
    data = {sec: {k: v for k, v in keys.items()
                  if v != base[sec].get(k) or k in ALWAYS.get(sec, ())}
            for sec, keys in mine.items()}
    return head + yaml.safe_dump({s: d for s, d in data.items() if d}, sort_keys=False)


def advise_splits(window: Any, serve_config: dict) -> list:
    """The live planner's advisor (cluster/serve/planner.py): every split of the window's
    workers simulated on its arrivals, with the serve config's cost model (its emulated
    device, or model.emulate's calibration file); a SplitScore per split."""
    from bench.workload import WorkloadRequest
    from cluster.serve.planner import SplitScore
    from sim.costs import cost_model

    cfg = ServeConfig.from_dict(serve_config)
    m = cfg.model
    if m.emulate is None:
        raise ValueError("the planner's simulator needs a cost model: serve with --emulate "
                         "PROFILE|cal.json (a calibration of the real device)")
    json_file = m.emulate.endswith(".json")
    costs = cost_model(m.emulate if json_file else None, None if json_file else m.emulate,
                       m.model_shape, m.dtype)
    vocab = int(costs.calibration.get("model")["vocab_size"])
    requests = [WorkloadRequest(f"plan-{i}", offset,
                                [(i * 7919 + k * 31 + 1) % vocab for k in range(prompt)],
                                output, tenant)
                for i, (offset, prompt, output, tenant) in enumerate(window.arrivals)]
    # an analytic profile's links are a cluster's (the emulated service's KV link is the
    # transport's, slowed by transfer.link_gbps where set)
    opts = SimOptions() if m.emulate.endswith(".json") else SimOptions(interconnect="infiniband")
    plan = plan_splits(cfg, costs, opts, requests, window.workers, dict(window.slos_ms))
    return [SplitScore(o.candidate.prefill, o.candidate.decode, o.goodput_rps, o.ttft_p99_ms,
                       o.itl_p99_ms) for o in plan.outcomes]
