"""Validate the simulator against real runs on this machine.

    python -m bench.sim_validate                     # calibrate, run real + simulated, table
    python -m bench.sim_validate --calibration cal.json --quick
    python -m bench.sim_validate --reprint out/sim_validate.json
    python -m bench.sim_validate --record rec.pkl    # keep every real run of each row
    python -m bench.sim_validate --replay rec.pkl    # fit + simulate those runs again

Each configuration (1P1D and 1P2D, prefill chunks 64..512, eager and paced sends, fcfs
and srpt) runs for real -- Ray workers, the router, the TCP KV connector, traces on -- at
two load levels, and the same workload runs in the simulator (sim/). The simulator's
costs are measured in this run, under the machine's load of the moment: the calibration
(the median of its repeats, not the fastest) and the control plane on an idle 1P1D
service (``pdserve calibrate --stat median --control``) just before the real runs. Each
configuration and load first runs a contention run (the same mix, twice as many
requests: ``--contention-requests``) and ``--fit-runs`` (3) runs of the compared
workload as a calibration under load, and every under-load term comes from all of them
together (``merge_runs``): each role's step fitted to the workers' traces (with the
decode steps' spread and the step that legs join, bench/sim_validate_steps.py), the real
dispatch latency over the simulated one, each leg's KV handoff beyond the simulated one
(drawn per leg), and the token delivery refitted to their traces (sim/delivery.py's
mechanism, as ``--control`` fits it at idle) with its stalls scaled so the simulated ITL
p99 is the median of the fit runs' (a 60-request run's ITL p99 did not carry over to the
30-request workload: +12 to +26% on 4 rows). The compared workload also runs
``--repeats`` times (3), alternating with the fit runs so a drift of the host falls on
both alike; these runs are never fitted to: their median is compared with the median of
``--sim-seeds`` (5) simulated runs, each with its own draws of the drawn terms, and each
side's range is shown (the real one is the machine's noise). Before every real run a
machine canary (bench/machine_canary.py) times a fixed CPU job and a thread wake-up: the
table shows how far the job moved from a row's fit runs to its compared runs.
The table gives TTFT and ITL p50 / p99, real vs simulated, and the relative error; the
goal is 10%. Where a figure misses it, the last column names the term furthest off in
seconds among those the metric is made of: dispatch, prefill queue, prefill phase and
first-token delivery for TTFT; the decode step, the token delivery (a step's end to the
client) and the KV transfer for ITL -- each compared between the two runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

from bench.machine_canary import canary_s, wake_s
from bench.sim_validate_report import counts, describe, median_summary, summarize, table
from bench.sim_validate_steps import step_fits
from bench.sim_validate_terms import (
    arrival_residuals,
    contention,
    delivery_under_load,
    fit_link_factor,
    fit_stall_scale,
    handoff_mean,
    handoff_residuals,
)

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
    from cluster.config import ServeConfig

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
    from sim.scaled import ScaledCosts

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
    from sim.scaled import ScaledCosts

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


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sim_validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--calibration", help="use this calibration instead of measuring one")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--configs", help="comma-separated names of CONFIGS to run")
    p.add_argument("--num-requests", type=int, default=30, help="per load level")
    p.add_argument("--contention-requests", type=int, default=None,
                   help="requests of the contention run the under-load terms are fitted "
                        "to (default: twice --num-requests)")
    p.add_argument("--repeats", type=int, default=3,
                   help="real runs compared (their median), alternating with the fit runs")
    p.add_argument("--fit-runs", type=int, default=3,
                   help="runs of the compared workload, alternating with the compared ones: every "
                        "under-load term is fitted to them with the contention run, and "
                        "the delivery's stalls scaled to their median ITL p99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-seeds", type=int, default=5,
                   help="simulated runs per row, each with its own draws of the drawn terms "
                        "(the steps' spread, each leg's KV handoff); their median is "
                        "compared, as the real repeats' is")
    p.add_argument("--out", default="sim_validate_out", help="calibration, JSON, table")
    p.add_argument("--reprint", metavar="JSON", help="print the table of an earlier run's "
                   "sim_validate.json and exit")
    runs = p.add_mutually_exclusive_group()  # a replay has no real runs to record
    runs.add_argument("--record", metavar="FILE", help="pickle every real run of each row to "
                      "FILE as the row ends, for --replay")
    runs.add_argument("--replay", metavar="FILE", help="no real runs: fit and simulate the "
                      "rows recorded in FILE (--record) with this code, on the recorded "
                      "calibration unless --calibration; the same workload flags as the "
                      "recording")
    p.add_argument("--ablate", action="store_true", help="with --reprint: simulate its rows "
                   "again with each under-load term on and off (the same real runs, factors "
                   "and calibration) and print the counts of each")
    return p.parse_args(argv)


def ablate(data: dict, model: str, n: int, seed: int, seeds: int) -> None:
    """The rows of an earlier run simulated again with the idle or the loaded delivery and
    with or without the fitted link factor: which under-load term moves which figure."""
    from engine.loader import load_model_config
    from sim.adapters import resolve_model_dir
    from sim.calibration import Calibration
    from sim.cost_loader import load_costs
    from sim.delivery import Delivery
    from sim.scaled import StepFit

    costs = load_costs(Calibration.load(data["calibration"]))
    model_dir = str(resolve_model_dir(model))
    vocab, base = load_model_config(model_dir).vocab_size, base_config(model_dir)
    for refit, link in ((False, False), (False, True), (True, False), (True, True)):
        rows = []
        for r in data["rows"]:
            reqs = workload(n, LOADS[r["load"].split()[0]], vocab, seed)
            f = {**r["factors"], **({} if link else {"link": 1.0})}
            d = Delivery(**r["delivery_fit"]) if refit and r.get("delivery_fit") else None
            steps = {k: StepFit(**v) for k, v in r.get("step_fits", {}).items()}
            sims = seeded(config_for(base, CONFIGS[r["config"]]), reqs, costs, f, d, steps,
                          r.get("handoff_fit", []), seeds,
                          [tuple(x) for x in r.get("arrival_fit", [])])
            rows.append({**r, "sim": median_summary([summarize(x) for x in sims])})
        print(f"-- delivery {'refitted under load' if refit else 'idle'}, KV link "
              f"{'fitted to the handoff' if link else 'idle'}:\n{counts(rows)}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if min(args.repeats, args.sim_seeds, args.fit_runs) < 1:
        raise SystemExit("--repeats, --sim-seeds and --fit-runs must be >= 1")
    if args.reprint:
        data = json.loads(Path(args.reprint).read_text())
        print(f"cost model: {data['label']}\n{data.get('header', '')}\n{table(data['rows'])}\n"
              f"{counts(data['rows'])}")
        if args.ablate:
            ablate(data, args.model, args.num_requests, args.seed, args.sim_seeds)
        return 0
    logging.basicConfig(level=logging.WARNING)
    from bench import sim_validate_record as record
    from bench.studies.service import ServicePool, ensure_ray
    from sim.adapters import resolve_model_dir
    from sim.calibrate import calibrate
    from sim.calibration import Calibration
    from sim.cost_loader import load_costs
    from sim.measure_control import add_control

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(resolve_model_dir(args.model))
    names = (args.configs.split(",") if args.configs else list(QUICK if args.quick else CONFIGS))
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configuration(s) {sorted(unknown)}; known: {list(CONFIGS)}")
    t0 = time.monotonic()
    base = base_config(model_dir)
    recording = record.load(args.replay, args) if args.replay else None
    if recording is None:
        ensure_ray(num_cpus=4)
    cal_path = args.calibration or (recording["calibration"] if recording
                                    else str(out / "calibration.json"))
    if not args.calibration and recording is None:
        # the median under the machine's load now (the runs share it), not the fastest
        print(f"calibrating {model_dir} on this machine -> {cal_path}")
        calibrate(model_dir, out=cal_path, max_model_len=MAX_MODEL_LEN, max_batch_tokens=512,
                  max_seqs=64, stat="median", log=lambda s: print(f"  {s}"))
        add_control(cal_path, base.with_values({"pools.prefill_workers": 1,
                                                "pools.decode_workers": 1}),
                    log=lambda s: print(f"  {s}"))
    costs = load_costs(Calibration.load(cal_path))
    machine = {"canary_ms": round(canary_s() * 1e3, 3), "wake_us": round(wake_s() * 1e6, 1)}
    print(f"cost model: {costs.label}; machine canary {machine['canary_ms']:.2f} ms, two "
          f"threads' wake-up round trip {machine['wake_us']:.0f} us")
    from engine.loader import load_model_config

    vocab = load_model_config(model_dir).vocab_size
    # the traces give the control-plane terms
    pool = ServicePool(trace=True) if recording is None else None
    rows: list[dict] = []
    recorded: dict[str, list] = {}
    try:
        for name in names:
            cfg = config_for(base, CONFIGS[name])
            svc = pool.get(cfg) if pool is not None else None
            for load, rate in LOADS.items():
                key = record.row_key(name, load)
                if recording is not None:
                    if key not in recording["rows"]:
                        continue
                    runner = record.Replayer(recording["rows"][key], key)
                else:
                    runner = record.Recorder(svc) if args.record else svc
                row = validate_row(runner, cfg, costs, name, load, rate, vocab, args)[0]
                if recording is not None:  # the canary timed this machine now, not the runs
                    row.update(canary_ms={}, wake_us=[], replayed=args.replay)
                if args.record:
                    recorded[key] = runner.runs
                    record.save(args.record, args, cal_path, recorded)
                rows.append(row)
                print(table([row]).splitlines()[-1], f"(load {os.getloadavg()[0]:.1f})",
                      flush=True)
    finally:
        if pool is not None:
            pool.close()
    text = table(rows)
    header = (f"replayed: the real runs recorded in {args.replay}, fitted and simulated by "
              "this code\n" if recording is not None else "") + describe(costs.calibration, rows)
    print(f"\nsimulated vs real on this machine ({time.monotonic() - t0:.0f} s); "
          f"cost model: {costs.label}\n{header}\n{text}")
    print(counts(rows))
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    (out / "sim_validate.md").write_text(header + "\n" + text + "\n" + counts(rows) + "\n")
    (out / "sim_validate.json").write_text(json.dumps(
        {"calibration": cal_path, "label": costs.label, "header": header, "rows": rows,
         "machine_after_calibration": machine}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
