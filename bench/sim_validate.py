"""Validate the simulator against real runs on this machine.

    python -m bench.sim_validate                     # calibrate, run real + simulated, table
    python -m bench.sim_validate --calibration cal.json --quick
    python -m bench.sim_validate --reprint out/sim_validate.json

Each configuration (1P1D and 1P2D, prefill chunks 64..512, eager and paced sends, fcfs
and srpt) runs for real -- Ray workers, the router, the TCP KV connector, traces on -- at
two load levels, and the same workload runs in the simulator (sim/). The simulator's
costs are measured in this run, under the machine's load of the moment: the calibration
(the median of its repeats, not the fastest) and the control plane on an idle 1P1D
service (``pdserve calibrate --stat median --control``) just before the real runs. Each
real workload runs twice: the first run gives this configuration's contention on this
machine (per role, the real workers' mean step time over the simulator's; for the
control plane, the real dispatch latency over the simulated one), which scales the
costs the second run is compared with, and run 1 vs run 2 is the machine's noise floor.
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
import time
from pathlib import Path
from typing import Any

import numpy as np

GOAL = 0.10
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


def _by_request(events) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for e in events:  # leg ids are "<request_id>#...": the request's legs together
        out.setdefault(e.request_id.split("#")[0], {}).setdefault(e.phase, []).append(e)
    return out


def control_terms(out) -> dict[str, float | None]:
    """From the traces against the client's times (wall clock): dispatch (send -> first
    prefill chunk), first-token delivery (last chunk's end -> first token) and token
    delivery p50 / p99 (a decode step's end -> its token at the client)."""
    ev, off = _by_request(out.events), out.wall_offset
    dispatch, first, lags = [], [], []
    for r in out.records:
        e = ev.get(r.request_id, {})
        chunks = sorted(e.get("prefill_chunk", []), key=lambda x: x.start)
        steps = sorted(e.get("decode_step", []), key=lambda x: x.end)
        if not r.success or not chunks or not r.token_times:
            continue
        t = [x + off for x in r.token_times]
        dispatch.append(chunks[0].start - (r.send_time + off))
        first.append(t[0] - chunks[-1].end)
        if len(steps) == len(t) - 1:  # one leg, no preemption: step k made token k + 1
            lags += [a - s.end for a, s in zip(t[1:], steps, strict=True)]
    q = (lambda xs, p: float(np.percentile(xs, p)) if xs else None)  # noqa: E731
    return {f"{name} p{p}": q(xs, p) for name, xs in (
        ("dispatch", dispatch), ("first-token delivery", first), ("token delivery", lags))
        for p in (50, 99)}


def summarize(out) -> dict[str, Any]:
    """TTFT / ITL percentiles and the terms the diagnosis compares."""
    from bench.metrics import compute_metrics
    from bench.studies.service import mean_step_s

    m = compute_metrics(out.records)

    def pct(field: str, p: int) -> float | None:
        xs = [getattr(r, field) for r in out.records if getattr(r, field) is not None]
        return float(np.percentile(xs, p)) if xs else None

    return {"ttft_p50": m.ttft.median, "ttft_p99": m.ttft.percentiles[99.0],
            "itl_p50": m.itl.median, "itl_p99": m.itl.percentiles[99.0],
            "completed": m.completed, "failed": m.failed,
            "terms": {"prefill step": mean_step_s(out.worker_stats, "prefill"),
                      "decode step": mean_step_s(out.worker_stats, "decode"),
                      **{f"{name} p{p}": pct(field, p) for name, field in (
                          ("prefill queue", "queue_s"), ("prefill phase", "prefill_s"),
                          ("KV transfer", "transfer_s")) for p in (50, 99)},
                      **control_terms(out)}}


def contention(real, sim) -> dict[str, float]:
    """Per role: the real workers' mean step time over the simulator's on the same run;
    for the control plane: the real median dispatch latency over the simulated one."""
    from bench.studies.service import mean_step_s

    out = {}
    for role in ("prefill", "decode"):
        a, b = mean_step_s(real.worker_stats, role), mean_step_s(sim.worker_stats, role)
        out[role] = a / b if a and b else 1.0
    a, b = control_terms(real)["dispatch p50"], control_terms(sim)["dispatch p50"]
    out["control"] = a / b if a and b and a > 0 and b > 0 else 1.0
    return out


def rel(real: float | None, sim: float | None) -> float | None:
    if real is None or sim is None or real <= 0:
        return None
    return (sim - real) / real


# the terms a metric is made of: TTFT = dispatch + queueing + the prefill's steps + the
# first token's delivery; ITL p50 = a decode step or its delivery; ITL p99 = a decode step,
# the wait for a leg's KV or a late delivery
TERMS = {f"ttft_p{p}": tuple(f"{t} p{p}" for t in (
    "dispatch", "prefill queue", "prefill phase", "first-token delivery")) for p in (50, 99)}
TERMS.update({"itl_p50": ("decode step", "token delivery p50"),
              "itl_p99": ("decode step", "KV transfer p99", "token delivery p99")})


def diagnose(real: dict, sim: dict, metric: str) -> str:
    """The term of ``metric`` whose simulated value is furthest off in seconds (among those
    off in the same direction as the metric, when any is)."""
    if metric.startswith("itl") and real["terms"]["decode step"] and \
            (real[metric] < 0.5 * real["terms"]["decode step"]) != \
            (sim[metric] < 0.5 * sim["terms"]["decode step"]):
        # one side's client saw several steps' tokens at once and the other's did not
        side = "real" if real[metric] < sim[metric] else "simulated"
        return f"token delivery (only the {side} tokens arrive coalesced)"
    errs = {t: (real["terms"].get(t), sim["terms"].get(t)) for t in TERMS[metric]}
    errs = {t: (a, b) for t, (a, b) in errs.items() if a is not None and b is not None}
    if not errs:
        return "?"
    # the term furthest off in the direction the metric is off, if any is
    sign = 1 if sim[metric] > real[metric] else -1
    same = {k: v for k, v in errs.items() if (v[1] - v[0]) * sign > 0} or errs
    t = max(same, key=lambda k: abs(same[k][1] - same[k][0]))
    a, b = errs[t]
    gap = sim[metric] - real[metric]
    share = f", {(b - a) / gap:.0%} of the gap" if gap else ""
    return f"{t} {a * 1e3:.2f} -> {b * 1e3:.2f} ms{share}"


def describe(cal, rows: list[dict]) -> str:
    """What the simulated side knows: how its calibration and control plane were taken."""
    w, c = cal.data.get("workload", {}), cal.data.get("control", {})
    d, svc = c.get("delivery", {}), c.get("service", {})
    lines = [f"calibration: {w.get('stat', 'min')} of {w.get('repeats')} timings per point, "
             f"taken in this run before the real runs (load average "
             f"{', '.join(f'{x:.1f}' for x in w.get('load_average', []))})"]
    fs = [r["factors"] for r in rows if "factors" in r]
    if fs:
        lines.append(
            "compute scaled per row and role by the contention measured on a first run of the "
            "same configuration and workload just before the compared one (run 2): real mean "
            "step / simulated; prefill x" + "..x".join(f"{f:.2f}" for f in (
                min(f["prefill"] for f in fs), max(f["prefill"] for f in fs)))
            + ", decode x" + "..x".join(f"{f:.2f}" for f in (
                min(f["decode"] for f in fs), max(f["decode"] for f in fs)))
            + "; control plane (rpc_s and delivery) by real / simulated dispatch there: x"
            + "..x".join(f"{f:.2f}" for f in (
                min(f["control"] for f in fs), max(f["control"] for f in fs))))
    if svc:
        lines.append(
            f"control plane measured on a real 1P1D service at idle ({svc['requests']} "
            f"requests): dispatch {svc['dispatch_s_median'] * 1e3:.2f} ms (rpc_s = "
            f"{c['rpc_s'] * 1e3:.2f} ms per message), first token +{d['first_token_s'] * 1e3:.2f}"
            f" ms, tokens +{d['token_s'] * 1e3:.2f} ms after their step, "
            f"{d['gap_s'] * 1e3:.2f} ms between deliveries per {d['scope']}, every "
            f"{d.get('stall_every') or '-'}th held {d.get('stall_s', 0) * 1e3:.2f} ms longer "
            f"(fit error {svc['fit_mean_abs_err_s'] * 1e3:.2f} ms per quantile)")
    else:
        lines.append("control plane: " + cal.source_of("control.delivery"))
    return "\n".join(lines)


METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def table(rows: list[dict]) -> str:
    head = ("config", "load", "TTFT p50 ms real/sim/err", "TTFT p99 ms real/sim/err",
            "ITL p50 ms real/sim/err", "ITL p99 ms real/sim/err",
            "noise: run 1 vs 2 (TTFT p50/p99, ITL p50/p99)", "term off (sim vs real)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells, off = [r["config"], r["load"]], []
        for k in METRICS:
            a, b = r["real"][k], r["sim"][k]
            e = rel(a, b)
            cells.append(f"{a * 1e3:.1f} / {b * 1e3:.1f} / {e:+.0%}" if e is not None else "-")
            if e is not None and abs(e) > GOAL:
                off.append(f"{k}: {diagnose(r['real'], r['sim'], k)}")
        rep = r.get("repeat")
        noise = [rel(r["real"][k], rep[k]) for k in METRICS] if rep else []
        cells.append(" / ".join("-" if e is None else f"{e:+.0%}" for e in noise) or "-")
        cells.append("; ".join(dict.fromkeys(off)) or "within 10%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sim_validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--calibration", help="use this calibration instead of measuring one")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--configs", help="comma-separated names of CONFIGS to run")
    p.add_argument("--num-requests", type=int, default=30, help="per load level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="sim_validate_out", help="calibration, JSON, table")
    p.add_argument("--reprint", metavar="JSON", help="print the table of an earlier run's "
                   "sim_validate.json and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.reprint:
        data = json.loads(Path(args.reprint).read_text())
        print(f"cost model: {data['label']}\n{data.get('header', '')}\n{table(data['rows'])}")
        return 0
    logging.basicConfig(level=logging.WARNING)
    from bench.studies.service import ServicePool, ensure_ray
    from sim.adapters import resolve_model_dir
    from sim.calibrate import calibrate
    from sim.calibration import Calibration
    from sim.cluster import simulate_config
    from sim.cost_loader import load_costs
    from sim.measure_control import add_control
    from sim.options import SimOptions
    from sim.scaled import ScaledCosts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(resolve_model_dir(args.model))
    names = (args.configs.split(",") if args.configs else list(QUICK if args.quick else CONFIGS))
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configuration(s) {sorted(unknown)}; known: {list(CONFIGS)}")
    t0 = time.monotonic()
    base = base_config(model_dir)
    ensure_ray(num_cpus=4)
    cal_path = args.calibration or str(out / "calibration.json")
    if not args.calibration:
        # the median under the machine's load now (the runs share it), not the fastest
        print(f"calibrating {model_dir} on this machine -> {cal_path}")
        calibrate(model_dir, out=cal_path, max_model_len=MAX_MODEL_LEN, max_batch_tokens=512,
                  max_seqs=64, stat="median", log=lambda s: print(f"  {s}"))
        add_control(cal_path, base.with_values({"pools.prefill_workers": 1,
                                                "pools.decode_workers": 1}),
                    log=lambda s: print(f"  {s}"))
    costs = load_costs(Calibration.load(cal_path))
    print(f"cost model: {costs.label}")
    from engine.loader import load_model_config

    vocab = load_model_config(model_dir).vocab_size
    pool = ServicePool(trace=True)  # the traces give the control-plane terms
    rows: list[dict] = []
    try:
        for name in names:
            cfg = config_for(base, CONFIGS[name])
            svc = pool.get(cfg)
            for load, rate in LOADS.items():
                # the contention of this configuration at this load on this machine, from a
                # first run of the same workload just before: real mean step / simulated per
                # role, real / simulated dispatch; that run against the second is the noise
                reqs = workload(args.num_requests, rate, vocab, args.seed)
                first = svc.run_workload(reqs, transport="inproc")
                factors = contention(first, simulate_config(cfg, reqs, costs,
                                                            SimOptions(trace=True)))
                scaled = ScaledCosts(costs, factors, "contention run before this one")
                real = svc.run_workload(reqs, transport="inproc")
                sim = simulate_config(cfg, reqs, scaled, SimOptions(trace=True))
                row = {"config": name, "load": f"{load} ({rate:g}/s)", "factors": factors,
                       "real": summarize(real), "sim": summarize(sim),
                       "repeat": summarize(first)}
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    finally:
        pool.close()
    text = table(rows)
    header = describe(costs.calibration, rows)
    print(f"\nsimulated vs real on this machine ({time.monotonic() - t0:.0f} s); "
          f"cost model: {costs.label}\n{header}\n{text}")
    misses = sum("within" not in line for line in text.splitlines()[2:])
    print(f"{len(rows) - misses} of {len(rows)} rows within {GOAL:.0%} at p50 and p99")
    (out / "sim_validate.md").write_text(header + "\n" + text + "\n")
    (out / "sim_validate.json").write_text(json.dumps(
        {"calibration": cal_path, "label": costs.label, "header": header, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
