"""Validate the simulator against real runs on this machine.

    python -m tools.sim_validate                     # calibrate, run real + simulated, table
    python -m tools.sim_validate --calibration cal.json --quick
    python -m tools.sim_validate --reprint out/sim_validate.json
    python -m tools.sim_validate --record rec.pkl    # keep every real run of each row
    python -m tools.sim_validate --replay rec.pkl    # fit + simulate those runs again

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
decode steps' spread and the step that legs join, tools/sim_validate_fits.py), the real
dispatch latency over the simulated one, each leg's KV handoff beyond the simulated one
(drawn per leg), and the token delivery refitted to their traces (engine/costs/delivery.py's
mechanism, as ``--control`` fits it at idle) with its stalls scaled so the simulated ITL
p99 is the median of the fit runs' (a 60-request run's ITL p99 did not carry over to the
30-request workload: +12 to +26% on 4 rows). The compared workload also runs
``--repeats`` times (3), alternating with the fit runs so a drift of the host falls on
both alike; these runs are never fitted to: their median is compared with the median of
``--sim-seeds`` (5) simulated runs, each with its own draws of the drawn terms, and each
side's range is shown (the real one is the machine's noise). Before every real run a
machine canary (tools/machine_canary.py) times a fixed CPU job and a thread wake-up: the
table shows how far the job moved from a row's fit runs to its compared runs.
The table gives TTFT and ITL p50 / p99, real vs simulated, and the relative error; the
goal is 10%. Where a figure misses it, the last column names the term furthest off in
seconds among those the metric is made of: dispatch, prefill queue, prefill phase and
first-token delivery for TTFT; the decode step, the token delivery (a step's end to the
client) and the KV transfer for ITL -- each compared between the two runs.

Recorded validation rows: every real run of a row kept, so the fits and simulations of
tools/sim_validate.py can be replayed offline on the very same runs.

A validation takes ~22 min here and its real side moves with the host, so two variants of
the model compared on two validations differ by the host as much as by the model. With
``--record FILE`` each row's real runs (records, traces, worker stats) are pickled as the
row ends; ``--replay FILE`` runs ``validate_row`` on them instead of a service: the same
runs in the same order, fitted and simulated by the code of the moment, in ~30 s a row.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

from tools.machine_canary import canary_s, wake_s
from tools.sim_validate_report import counts, describe, median_summary, summarize, table
from tools.sim_validate_row import (
    CONFIGS,
    LOADS,
    MAX_MODEL_LEN,
    QUICK,
    base_config,
    config_for,
    seeded,
    validate_row,
    workload,
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.sim_validate", description=__doc__,
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
    from engine.costs.calibration import Calibration
    from engine.costs.delivery import Delivery
    from engine.costs.loader import load_costs
    from engine.loader import load_model_config
    from sim.adapters import resolve_model_dir
    from tools.sim_scaled import StepFit

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
    from bench.studies.service import ServicePool, ensure_ray
    from engine.costs.calibration import Calibration
    from engine.costs.loader import load_costs
    from sim.adapters import resolve_model_dir
    from sim.calibrate import calibrate
    from sim.measure_control import add_control
    from tools import sim_validate as record

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


FORMAT = 1
SHAPE = ("num_requests", "contention_requests", "fit_runs", "repeats", "seed")


class Recorder:
    """A service whose runs are kept in the order they ran."""

    def __init__(self, svc: Any):
        self.svc, self.runs = svc, []

    def run_workload(self, work, transport: str = "inproc"):
        out = self.svc.run_workload(work, transport=transport)
        self.runs.append(out)
        return out


class Replayer:
    """Stands for the service of a recorded row: each call answers the next recorded run,
    which must be a run of the workload asked for."""

    def __init__(self, runs: list, row: str):
        self.runs, self.row = list(runs), row

    def run_workload(self, work, transport: str = "inproc"):
        if not self.runs:
            raise ValueError(f"the recording of {self.row} has no run left: it was recorded "
                             "with other --fit-runs / --repeats")
        out = self.runs.pop(0)
        if len(out.records) != len(work):
            raise ValueError(f"the recording of {self.row} has a run of {len(out.records)} "
                             f"requests where this replay sends {len(work)}: it was recorded "
                             "with other --num-requests / --contention-requests")
        return out


def row_key(config: str, load: str) -> str:
    return f"{config}|{load}"


def save(path: str | Path, args, calibration: str, rows: dict[str, list]) -> None:
    """Write the rows recorded so far (after each row: a stopped validation keeps them)."""
    data = {"format": FORMAT, "calibration": calibration,
            "shape": {k: getattr(args, k) for k in SHAPE}, "rows": rows}
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(pickle.dumps(data))
    tmp.replace(path)


def load(path: str | Path, args) -> dict:
    """A recording, checked against this replay's workload flags."""
    data = pickle.loads(Path(path).read_bytes())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a sim_validate recording of format {FORMAT}")
    moved = {k: (v, getattr(args, k)) for k, v in data["shape"].items()
             if getattr(args, k) != v}
    if moved:
        raise ValueError(f"{path} was recorded with other workload flags (recorded, now): "
                         + ", ".join(f"--{k.replace('_', '-')} {a} != {b}"
                                     for k, (a, b) in moved.items()))
    return data
