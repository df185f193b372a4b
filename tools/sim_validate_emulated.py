"""Validate the simulator against the real service on the emulated accelerator (issue 41).

    python -m tools.sim_validate_emulated --out DIR                 # the ten rows
    python -m tools.sim_validate_emulated --rows 1p1d-512-eager-low,2p2d-512-eager-high
    python -m tools.sim_validate_emulated --reprint DIR/sim_validate_emulated.json

Each row is one configuration at one load. It runs ``--repeats`` times for real: Ray
workers, the router and the tcp KV connector, on the emulated device
(``--emulate PROFILE --model-shape SHAPE``: step times from the analytic cost model, real
KV bytes, ``--emulate-kv-fraction`` of them sent, the link charged in full at
``--link-gbps``). It then runs once in the simulator (sim/) with the same configuration,
the same seeded workload and the same cost model. The simulator has no draws here, so
one run is its answer. The real runs' median is compared with it, and their range shows
the host's noise. Both sides drive the router in process (bench/studies/service.py's
inproc transport), so neither has a gRPC client's trip.

The table gives TTFT and ITL p50 / p99, real (median of the repeats) against simulated,
with the relative error; the goal is 10%. A row that misses names the term furthest off,
in ms:
- for TTFT: the admission wait, the prefill queue and the prefill phase (records' medians);
- for ITL: the mean decode step (worker statistics) and the KV transfer (records' median).

Every figure is labelled with the cost model: the emulated service's step times are the
model's, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GOAL = 0.10
METRICS = (("ttft", 50.0), ("ttft", 99.0), ("itl", 50.0), ("itl", 99.0))
RATES = {"low": 8.0, "high": 24.0}  # requests/s
NUM_BLOCKS = 512  # per worker, both sides (8,192 tokens at block 16): the same KV pool


@dataclass(frozen=True)
class Row:
    """One configuration at one load (what a validation row serves)."""

    name: str
    prefill: int
    decode: int
    chunk: int
    send_policy: str = "eager"  # eager | paced | at_end
    policy: str = "fcfs"  # the prefill scheduler's fairness policy
    tenants: bool = False  # two tenants at weights 2 : 1 (wfq at the three resources)
    prefix: bool = False  # shared-prefix prompts with prefix caching on
    load: str = "high"

    def overrides(self, link_gbps: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pools.prefill_workers": self.prefill, "pools.decode_workers": self.decode,
            "scheduler.max_prefill_chunk": self.chunk,
            "scheduler.max_num_batched_tokens": max(self.chunk, 256),
            "scheduler.fairness_policy": self.policy,
            "transfer.send_policy": self.send_policy,
            "transfer.rate_gbps": link_gbps / 2 if self.send_policy == "paced" else None,
            "cache.num_blocks": NUM_BLOCKS, "cache.enable_prefix_caching": self.prefix,
        }
        if self.tenants:
            out.update({"transfer.send_queue": "wfq", "scheduler.decode_admission": "wfq"})
        return out


ROWS = (
    Row("1p1d-512-eager-low", 1, 1, 512, load="low"),
    Row("1p1d-512-eager-high", 1, 1, 512),
    Row("1p1d-128-eager-high", 1, 1, 128),
    Row("1p1d-512-paced-high", 1, 1, 512, send_policy="paced"),
    Row("1p1d-512-at_end-high", 1, 1, 512, send_policy="at_end"),
    Row("1p1d-256-srpt-high", 1, 1, 256, policy="srpt"),
    Row("1p1d-256-wfq2-high", 1, 1, 256, policy="wfq", tenants=True),
    Row("1p2d-512-eager-high", 1, 2, 512),
    Row("2p2d-128-eager-low", 2, 2, 128, load="low"),
    Row("1p1d-512-prefix-high", 1, 1, 512, prefix=True),
)


def workload(ctx, row: Row, n: int) -> list:
    """The row's seeded requests: chats with a share of long prompts (or shared-prefix
    prompts), Poisson arrivals at the row's load; two tenants where the row says."""
    from bench.studies.common import mixed_workload
    from bench.workload import LengthDist, TenantSpec, WorkloadSpec, build_workload

    rate = RATES[row.load]
    tenants = (TenantSpec("gold", share=0.5, weight=2.0),
               TenantSpec("free", share=0.5, weight=1.0)) if row.tenants else None
    if row.prefix:
        spec = WorkloadSpec(num_requests=n, request_rate=rate, mix="shared-prefix",
                            seed=ctx.opts.seed, vocab_range=ctx.vocab_range,
                            prompt_len=LengthDist.uniform(32, 128),
                            output_len=LengthDist.uniform(32, 64), num_prefix_groups=4,
                            prefix_len=512, max_model_len=ctx.max_model_len,
                            id_prefix=f"{row.name}-")
        return build_workload(spec)
    reqs, _ = mixed_workload(ctx, n=n, rate=rate, tag=row.name, long_fraction=0.15,
                             tenants=tenants, chat_prompt=(128, 512), chat_output=(32, 64),
                             long_prompt=(1024, 1536), long_output=(8, 16))
    return reqs


def figures(run) -> dict[str, float | None]:
    """A run's compared figures (ms) and the terms they are made of."""
    from bench.studies.config_run import p, step_ms

    m, recs = run.metrics, [r for r in run.records if r.success]
    out: dict[str, float | None] = {f"{d}_p{int(q)}": p(m, d, q) for d, q in METRICS}

    def med(attr: str) -> float | None:
        v = [getattr(r, attr) for r in recs if getattr(r, attr) is not None]
        return statistics.median(v) * 1e3 if v else None

    out.update(admission=med("admission_s"), prefill_queue=med("queue_s"),
               prefill=med("prefill_s"), transfer=med("transfer_s"),
               decode_step=step_ms(run, "decode"), failed=float(m.failed))
    return out


TERMS = {"ttft": ("admission", "prefill_queue", "prefill"), "itl": ("decode_step", "transfer")}


def compare(real: list[dict], sim: dict) -> dict[str, Any]:
    """The row's comparison: the real repeats' median and range, the simulated figure,
    the relative error, and for a miss the term furthest off."""
    row: dict[str, Any] = {"real_runs": real, "sim": sim}
    for d, q in METRICS:
        key = f"{d}_p{int(q)}"
        vals = [r[key] for r in real if r[key] is not None]
        med = statistics.median(vals) if vals else None
        err = None if not med or sim[key] is None else sim[key] / med - 1
        spread = (max(vals) - min(vals)) / med if med and len(vals) > 1 else None
        off = None
        if err is not None and abs(err) > GOAL:
            gaps = {t: sim[t] - statistics.median([r[t] for r in real if r[t] is not None])
                    for t in TERMS[d] if sim[t] is not None
                    and any(r[t] is not None for r in real)}
            if gaps:
                t = max(gaps, key=lambda k: abs(gaps[k]))
                off = f"{t} {gaps[t]:+.2f} ms"
        row[key] = {"real": med, "sim": sim[key], "err": err, "spread": spread, "off": off}
    return row


def host_fitted(sim, cfg, work, fit, bare):
    """The simulated run with the host's share measured on ``fit`` (a real run of the
    row's workload that is not compared): each role's step as the real traced steps give
    it (scale, offset, overhead, spread: with the host one step ahead the decode step's
    host work hides behind the device's, which the cost model's serial step overhead does
    not) and each leg's KV handoff beyond the simulated one, drawn per leg (the host's
    export, socket and intake under load: sim_validate's terms, tools/sim_validate_fits.py)."""
    from bench.studies.config_run import ConfigRun
    from sim.cluster import simulate_config
    from tools.sim_scaled import ScaledCosts
    from tools.sim_validate_fits import handoff_residuals, step_fits

    unit = {"prefill": 1.0, "decode": 1.0}
    steps = step_fits(fit.output, sim.costs, ScaledCosts(sim.costs, unit, "probe"))
    handoff = handoff_residuals(fit.output, bare.output)
    costs = ScaledCosts(sim.costs, unit, "the host's share fitted to a real run",
                        steps=steps, handoff=handoff)
    out = simulate_config(cfg, work, costs, sim.options)
    return ConfigRun(bare.name, cfg, bare.layout, out, slos=dict(sim.opts.slos))


def table(rows: dict[str, dict], label: str) -> str:
    head = ("| row | " + " | ".join(f"{d.upper()} p{int(q)} real / sim (ms)" for d, q in METRICS)
            + " | within 10% | real spread (max) | furthest off |")
    lines = [f"cost model: {label}", head, "|" + "---|" * 8]
    met = 0
    for name, row in rows.items():
        cells, ok, spreads, offs = [], True, [], []
        for d, q in METRICS:
            c = row[f"{d}_p{int(q)}"]
            if c["err"] is None:
                cells.append("n/a")
                ok = False
                continue
            cells.append(f"{c['real']:.2f} / {c['sim']:.2f} ({c['err']:+.0%})")
            ok &= abs(c["err"]) <= GOAL
            spreads.append(c["spread"] or 0.0)
            offs += [f"{d.upper()} p{int(q)}: {c['off']}"] if c["off"] else []
        met += ok
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if ok else 'no'} | "
                     f"{max(spreads, default=0):.0%} | {'; '.join(offs) or '-'} |")
    lines.append(f"{met} of {len(rows)} rows within 10% at TTFT and ITL p50 and p99")
    return "\n".join(lines)


def report(rows: dict[str, dict], label: str, host_fit: bool) -> str:
    """The table (with the host's share fitted, where it was), then the cost model alone."""
    text = table(rows, label)
    if host_fit:
        alone = table({n: r["device_only"] for n, r in rows.items()}, label)
        text += "\n\nThe cost model alone (no host terms):\n" + "\n".join(alone.splitlines()[1:])
    return text


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.sim_validate_emulated",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--emulate", default="h200", help="analytic profile of the emulated device")
    p.add_argument("--model-shape", default="llama-3-8b", help="model shape (engine/costs/analytic.py)")
    p.add_argument("--emulate-kv-fraction", type=float, default=1 / 32,
                   help="share of each chunk's KV bytes moved for real, the link charged in "
                   "full (default: one layer of llama-3-8b's 32, so that this host's copies "
                   "weigh least on the KV transfer the simulator models at the link's rate)")
    p.add_argument("--link-gbps", type=float, default=400.0, help="emulated KV link rate")
    p.add_argument("--rows", help=f"comma-separated rows (default all: {', '.join(r.name for r in ROWS)})")
    p.add_argument("--num-requests", type=int, default=48, help="requests per run")
    p.add_argument("--repeats", type=int, default=3, help="real runs per row")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--host-fit", action=argparse.BooleanOptionalAction, default=True,
                   help="fit the host's share (each role's step, each leg's KV handoff "
                   "beyond the model's) to one more real run of each row, not compared; "
                   "--no-host-fit: the cost model alone")
    p.add_argument("--out", default="sim_validate_emulated_out", help="JSON, table, traces")
    p.add_argument("--reprint", metavar="JSON", help="print the table of an earlier run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.reprint:
        data = json.loads(Path(args.reprint).read_text())
        print(report(data["rows"], data["label"], data["args"].get("host_fit", False)))
        return 0
    from bench.studies.context import EMULATED_SLOS, StudyContext, StudyOptions
    from sim.study import SimStudy, SimStudyContext

    by_name = {r.name: r for r in ROWS}
    names = args.rows.split(",") if args.rows else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown row(s) {unknown}; rows: {', '.join(by_name)}")
    out = Path(args.out)
    opts = StudyOptions(out=out, emulate=args.emulate, model_shape=args.model_shape,
                        emulate_kv_fraction=args.emulate_kv_fraction, link_gbps=args.link_gbps,
                        seed=args.seed, progress=False, slos=dict(EMULATED_SLOS))
    real = StudyContext(opts)
    sim = SimStudyContext(opts, SimStudy(analytic=args.emulate, model_shape=args.model_shape,
                                         load_scale=1.0, interconnect="infiniband"))
    label = real.opts.emulate_config.label
    print(f"sim_validate_emulated: {len(names)} rows, {args.repeats} real runs each, "
          f"{args.num_requests} requests a run; {label}", flush=True)
    rows: dict[str, dict] = {}
    t0 = time.monotonic()
    try:
        for name in names:
            row = by_name[name]
            cfg = real.base_config().with_values(row.overrides(args.link_gbps))
            work = workload(real, row, args.num_requests)
            fit = real.run("validate", f"{name}-fit", cfg, work) if args.host_fit else None
            runs = [figures(real.run("validate", name, cfg, work)) for _ in range(args.repeats)]
            bare = sim.run("validate", name, cfg, work)
            fitted = host_fitted(sim, cfg, work, fit, bare) if fit is not None else None
            rows[name] = compare(runs, figures(fitted if fitted is not None else bare))
            rows[name]["device_only"] = compare(runs, figures(bare))
            rows[name]["config"] = row.__dict__
            print(table({name: rows[name]}, label).splitlines()[3], flush=True)
    finally:
        real.close()
    text = report(rows, label, args.host_fit)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_validate_emulated.json").write_text(json.dumps(
        {"label": label, "args": vars(args), "rows": rows,
         "elapsed_s": time.monotonic() - t0}, indent=1, default=str))
    (out / "sim_validate_emulated.md").write_text(text + "\n")
    print(f"-> {out / 'sim_validate_emulated.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
