"""One row of tools/sim_validate.py's table: a configuration's real runs at one load (a
contention run, fit runs and compared runs, alternating), the under-load terms fitted to
them (tools/sim_validate_fits.py, tools/sim_validate_fits.py), and the seeded simulated
runs compared with the real ones.

What tools/sim_validate.py runs: its configurations, load levels and workload, and the
service configuration each one is served with.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from itertools import zip_longest
from typing import Any

import numpy as np

from tools.machine_canary import canary_s, wake_s
from tools.sim_validate_fits import (
    arrival_residuals,
    contention,
    delivery_under_load,
    fit_link_factor,
    fit_stall_scale,
    handoff_mean,
    handoff_residuals,
    step_fits,
)
from tools.sim_validate_report import median_summary, summarize


def timed_runs(svc, work: list, n: int, canary: list[float], wake: list[float]) -> list:
    """``n`` real runs of ``work``, each after the machine canary (its times appended to
    ``canary`` and ``wake``): whether the machine's speed moved between runs of a row."""
    out = []
    for _ in range(n):
        canary.append(canary_s())
        wake.append(wake_s())
        out.append(svc.run_workload(work, transport="inproc"))
    return out


def alternated_runs(svc, work: list, fits: int, repeats: int, canary: dict[str, list[float]],
                    wake: list[float]) -> tuple[list, list]:
    """``fits`` fit runs and ``repeats`` compared runs of ``work``, alternating (a fit run
    first): a drift of the host over the row's minutes falls on both alike. Run in turn
    (fits before compared), a row's TTFT p50 moved by up to +60% from its fit runs to its
    compared runs with the machine canary unchanged (val25, val27)."""
    order = [kind for pair in zip_longest(["fit"] * fits, ["compared"] * repeats)
             for kind in pair if kind]
    runs: dict[str, list] = {"fit": [], "compared": []}
    for kind in order:
        runs[kind] += timed_runs(svc, work, 1, canary[kind], wake)
    return runs["fit"], runs["compared"]


def as_fit_runs(run: Callable[[list], Any], creqs: list, reqs: list, n: int):
    """The simulated counterparts of a row's fit runs: ``run`` of the contention run's
    workload once and of the compared workload ``n`` times, merged as the real ones are."""
    from bench.studies.service import merge_runs

    once, again = run(creqs), run(reqs)
    return merge_runs([once] + [again] * n)


HANDOFF_MIN_LEGS = 10  # fewer matched legs: the mean handoff sets a link factor instead


def simulated(cfg, reqs: list, costs, factors: dict, delivery, steps=None, handoff=(),
              seed: int = 0, arrival=()):
    """The traced simulated run of ``reqs`` with the under-load terms given; ``seed`` picks
    the draws of the drawn terms (the steps' spread, each leg's handoff, each request's
    dispatch and first-token delivery)."""
    from sim.cluster import simulate_config
    from sim.options import SimOptions
    from tools.sim_scaled import ScaledCosts

    return simulate_config(cfg, reqs, ScaledCosts(costs, dict(factors), "probe",
                                                  delivery=delivery, steps=steps,
                                                  handoff=handoff, arrival=arrival,
                                                  seed=seed),
                           SimOptions(trace=True))


def seeded(cfg, reqs: list, costs, factors: dict, delivery, steps, handoff, seeds: int,
           arrival=()) -> list:
    """The simulated runs of seeds 0 .. ``seeds - 1``: the simulator's repeats, as the
    real side's are repeats of the same workload."""
    return [simulated(cfg, reqs, costs, factors, delivery, steps, handoff, seed=k,
                      arrival=arrival) for k in range(seeds)]


def link_probe(cfg, reqs: list, costs, factors: dict, delivery, steps=None):
    """``f -> the simulated run`` with the KV link's write time scaled by ``f``."""
    return lambda f: simulated(cfg, reqs, costs, {**factors, "link": f}, delivery, steps)


def stall_probe(cfg, reqs: list, costs, factors: dict, delivery, steps, handoff, seeds: int,
                arrival=()):
    """``f -> the seeded simulated runs`` with the delivery's stalls scaled by ``f``."""
    return lambda f: seeded(cfg, reqs, costs, factors,
                            replace(delivery, stall_s=delivery.stall_s * f), steps, handoff,
                            seeds, arrival)


def validate_row(svc, cfg, costs, name: str, load: str, rate: float, vocab: int,
                 args: argparse.Namespace) -> tuple[dict, list, list]:
    """One row of the table: the real runs of ``name`` at ``load`` on ``svc``, the terms
    fitted to them, and the simulated runs; returns the row with the compared real runs
    and the simulated ones (their records and traces, for a closer look)."""
    from bench.studies.service import merge_runs
    from sim.cluster import simulate_config
    from sim.options import SimOptions
    from tools.sim_scaled import ScaledCosts

    # the contention of this configuration at this load on this machine, from runs of
    # the same workload (a calibration under load): real mean step / simulated per role,
    # real / simulated dispatch and KV handoff, and the token delivery refitted to their
    # traces; the compared figure is the median of other repeats, their range the noise
    reqs = workload(args.num_requests, rate, vocab, args.seed)
    # the contention run is longer than a compared one: its fits (prefill slope, stall
    # size) move less from one run to the next
    creqs = workload(args.contention_requests or 2 * args.num_requests, rate,
                     vocab, args.seed)
    canary: dict[str, list[float]] = {"fit": [], "compared": []}
    wake: list[float] = []
    # and more runs of the compared workload (not the compared ones, which alternate with
    # them): every term is fitted to all of them (one run's terms carried its moment of
    # the machine: a slow run's decode step made a row's ITL p50 +15%, and on a host
    # whose speed moved the simulated TTFT p50 followed the first run's)
    first = timed_runs(svc, creqs, 1, canary["fit"], wake)[0]
    more, compared = alternated_runs(svc, reqs, args.fit_runs, args.repeats,
                                     canary, wake)
    pooled = merge_runs([first, *more])
    factors = contention(pooled, as_fit_runs(partial(
        simulate_config, cfg, costs=costs, options=SimOptions(trace=True)),
        creqs, reqs, len(more)))
    steps = step_fits(pooled, costs, ScaledCosts(costs, factors, "probe"))
    fit = delivery_under_load(pooled, ScaledCosts(costs, factors, "probe",
                                                  steps=steps))
    delivery = fit[0] if fit else None
    probe = as_fit_runs(partial(simulated, cfg, costs=costs, factors={**factors, "link": 1.0},
                                delivery=delivery, steps=steps), creqs, reqs, len(more))
    handoff = handoff_residuals(pooled, probe)
    # each request's dispatch and first-token delivery beyond the model's, drawn together
    arrival = arrival_residuals(pooled, probe, ScaledCosts(
        costs, factors, "probe", delivery=delivery, steps=steps))
    if len(handoff) >= HANDOFF_MIN_LEGS:  # each leg's own spread, at the idle link
        factors["link"] = 1.0
    else:
        handoff = []
        factors["link"] = fit_link_factor(handoff_mean(first), link_probe(
            cfg, creqs, costs, factors, delivery, steps))
    if delivery is not None and delivery.stall_every and delivery.stall_s > 0:
        # the ITL p99 moves with the workload's own mix of long prompts: one
        # run's ITL p99 moved 8-25% from the next
        target = float(np.median([summarize(r)["itl_p99"] for r in more]))
        f = fit_stall_scale(target, stall_probe(
            cfg, reqs, costs, factors, delivery, steps, handoff, args.sim_seeds, arrival))
        delivery = replace(delivery, stall_s=delivery.stall_s * f)
    reals = [summarize(x) for x in compared]
    sims = seeded(cfg, reqs, costs, factors, delivery, steps, handoff,
                  args.sim_seeds, arrival)
    row = {"config": name, "load": f"{load} ({rate:g}/s)", "factors": factors,
           "step_fits": {r: f.to_dict() for r, f in steps.items()},
           "delivery_fit": delivery.to_dict() if delivery else None,
           "handoff_fit": [round(x, 7) for x in handoff],
           "arrival_fit": [[round(d, 7), round(f, 7)] for d, f in arrival],
           "real": median_summary(reals),
           "sim": median_summary([summarize(x) for x in sims]),
           "contention_run": summarize(first), "runs": reals,
           "fit_runs": [summarize(r) for r in more], "run_order": "alternated",
           "canary_ms": {k: [round(x * 1e3, 3) for x in v]
                         for k, v in canary.items()},
           "wake_us": [round(x * 1e6, 1) for x in wake],
           "load_average": list(os.getloadavg())}
    return row, compared, sims


# name -> (pools P, D, prefill chunk, send policy, fairness policy); a fractional design
# over the factors (each level of each factor appears; ~1 min per configuration here)
CONFIGS: dict[str, tuple[int, int, int, str, str]] = {
    "1P1D-c256-eager-fcfs": (1, 1, 256, "eager", "fcfs"),
    "1P1D-c64-eager-fcfs": (1, 1, 64, "eager", "fcfs"),
    "1P1D-c512-eager-srpt": (1, 1, 512, "eager", "srpt"),
    "1P2D-c128-paced-srpt": (1, 2, 128, "paced", "srpt"),
    "1P2D-c256-eager-fcfs": (1, 2, 256, "eager", "fcfs"),
}
QUICK = ("1P1D-c256-eager-fcfs", "1P2D-c128-paced-srpt")
LOADS = {"low": 2.0, "high": 5.0}  # requests per second
PACED_GBPS = 0.05  # 6 MB/s: a 1,000-token prompt's KV (512 KiB on tiny) takes ~85 ms
MAX_MODEL_LEN = 2048


def base_config(model_dir: str):
    from cluster.config.serve import ServeConfig

    return ServeConfig.from_dict({
        "model": {"path": model_dir, "device": "cpu", "max_model_len": MAX_MODEL_LEN},
        "pools": {"cpus_per_worker": 1.0, "max_restarts": 0},
        "cache": {"kv_cache_memory_gb": 0.25, "enable_prefix_caching": False},
        "transfer": {"connector": "tcp"},
    })


def config_for(base, spec: tuple[int, int, int, str, str]):
    p, d, chunk, policy, fairness = spec
    values: dict[str, Any] = {
        "pools.prefill_workers": p, "pools.decode_workers": d,
        "scheduler.max_prefill_chunk": chunk, "scheduler.max_num_batched_tokens": 512,
        "scheduler.fairness_policy": fairness, "transfer.send_policy": policy}
    if policy == "paced":
        values.update({"transfer.rate_gbps": PACED_GBPS, "transfer.burst_mb": 0.0625})
    return base.with_values(values)


def workload(n: int, rate: float, vocab: int, seed: int) -> list:
    from bench.workload import LengthDist, WorkloadSpec, build_workload

    return build_workload(WorkloadSpec(
        num_requests=n, request_rate=rate, mix="mixed", seed=seed, vocab_range=(1, vocab - 1),
        prompt_len=LengthDist.uniform(32, 192), output_len=LengthDist.uniform(16, 48),
        long_prompt_len=LengthDist.uniform(600, 1400), long_output_len=LengthDist.uniform(8, 16),
        long_fraction=0.25, max_model_len=MAX_MODEL_LEN, id_prefix=f"v{rate:g}-"))
