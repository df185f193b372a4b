"""`pdserve simulate` and `pdserve calibrate`, plugged into cluster/cli.py (SUBCOMMANDS).

    pdserve calibrate --model tiny --quick --out cal.json
    pdserve simulate --calibration cal.json --prefill-workers 2 --decode-workers 4 \\
        --num-prompts 500 --request-rate 20 --mix mixed --json sim.json --trace-out sim-trace.json
    pdserve simulate --analytic h200 --model-shape llama-3-8b --interconnect infiniband \\
        --prefill-workers 8 --decode-workers 24 --request-rate 100 --num-prompts 360000

`simulate` takes `pdserve bench`'s workload flags (bench/workload_args.py, the same
argparse helper) and `pdserve serve`'s configuration flags and `--config` (generated
from ServeConfig by cluster/config/flags.py), prints bench's metric block and writes
bench's JSON keys. Module imports stay light: `pdserve --help` must be instant.
`--code`: the compiled build of `make sim-fast` (sim/compiled.py) runs when it is there and
matches the source (auto), or must run (compiled), or not (interpreted); the output says
which code ran.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bench.cli import register_simulator
from bench.workload_args import add_workload_args, workload_spec
from sim import compiled


def _calibration_source(p: argparse.ArgumentParser) -> None:
    # (--model-shape is the serve flag model.model_shape, and --emulate PROFILE|FILE, as
    # `pdserve serve --emulate` runs it, is a cost source too: the same cost model)
    g = p.add_argument_group("cost model (or --emulate PROFILE|FILE as `pdserve serve`; "
                             "--model-shape: a shape name or a HF model directory, default "
                             "llama-3-8b)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--calibration", metavar="FILE", help="calibration from `pdserve calibrate`")
    src.add_argument("--analytic", metavar="PROFILE", help="an analytic hardware profile "
                     "(h200, h100, a100): roofline, not measured")
    g.add_argument("--analytic-dtype", default="bfloat16", help="with --analytic (default "
                   "bfloat16)")
    g.add_argument("--client-ms", type=float, default=None, help="with an analytic profile: "
                   "the client <-> front door trip one way, ms (default 0: an in-process "
                   "client, as the studies'; a gRPC client across processes pays its "
                   "transport's, e.g. a bare grpc.aio echo's half round trip)")


def _add_simulator_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    _calibration_source(p)
    s = p.add_argument_group("simulator")
    s.add_argument("--placement", help="prefill placement policy (cluster/router/policies.py: "
                   "least-outstanding, prefix-affinity, length-buckets; default: the router's)")
    s.add_argument("--length-buckets", default="256,1024,4096",
                   help="length-buckets: prompt-length thresholds (default 256,1024,4096)")
    s.add_argument("--decode-order", default="least-kv-usage",
                   help="order the router asks decode workers (least-kv-usage, least-legs)")
    s.add_argument("--stats-refresh-s", type=float, default=None,
                   help="how often the router refreshes decode KV usage (default: as the "
                   "service: every 1 s with --metrics-port, else never)")
    s.add_argument("--interconnect", help="link cost entry of the calibration (default: "
                   "transfer.connector; analytic profiles: nvlink, infiniband)")
    s.add_argument("--decode-stepping", choices=("fast", "exact"), default="fast",
                   help="exact: the decode scheduler runs every step (slower, same result)")
    return s


def _sim_options(args: argparse.Namespace, trace: bool = False):
    from sim.options import SimOptions

    return SimOptions(
        placement=args.placement, decode_order=args.decode_order,
        length_buckets=tuple(int(x) for x in args.length_buckets.split(",") if x),
        interconnect=args.interconnect, decode_stepping=args.decode_stepping,
        stats_refresh_s=args.stats_refresh_s, trace=trace,
        max_concurrency=getattr(args, "max_concurrency", None))


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    from cluster.config.flags import add_cli_flags

    s = _add_simulator_args(p)
    s.add_argument("--trace-out", metavar="OUT", help="write a Perfetto trace of the run here "
                   "(engine/tracing.py events on the simulated clock)")
    s.add_argument("--code", choices=compiled.CODES, default="auto",
                   help="the compiled build of `make sim-fast` (auto: when present and "
                   "current, from the command line) or the source")
    b = p.add_argument_group("bench output")
    b.add_argument("--slo", default="", help="goodput SLOs in ms, e.g. ttft:500,tpot:50")
    b.add_argument("--long-prompt-threshold", type=int, default=1024,
                   help="prompts longer than this are 'long' for the short-TTFT line")
    b.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight; later arrivals wait (default: unlimited)")
    b.add_argument("--json", metavar="OUT", help="write metrics, workload and records here")
    b.add_argument("--no-records", action="store_true", help="--json without per-request records")
    add_workload_args(p)
    add_cli_flags(p)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    from cluster.config.flags import add_cli_flags

    _add_simulator_args(p)
    g = p.add_argument_group("plan")
    g.add_argument("--gpus", type=int, required=True,
                   help="workers (GPUs) to split between the prefill and decode pools")
    g.add_argument("--slo", required=True, help="the SLOs goodput counts by, in ms, e.g. "
                   "ttft:500,tpot:50 (ttft, tpot, e2el)")
    g.add_argument("--chunk-sizes", default="", help="prefill chunk sizes to try with each "
                   "split, e.g. 256,512 (default: scheduler.max_prefill_chunk alone)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight; later arrivals wait (default: unlimited)")
    g.add_argument("--out-config", metavar="FILE", help="write the recommended configuration "
                   "here (YAML for `pdserve serve --config FILE`)")
    g.add_argument("--json", metavar="OUT", help="write every candidate's figures here")
    add_workload_args(p)
    add_cli_flags(p)


def load_cost_model(args: argparse.Namespace):
    from sim.costs import cost_model

    emulate = vars(args).get("model.emulate")
    calibration = args.calibration or (emulate if emulate and emulate.endswith(".json") else None)
    analytic = args.analytic or emulate
    if calibration is None and analytic is None:
        raise SystemExit("pdserve simulate: a cost model is needed: --calibration FILE, "
                         "--analytic PROFILE or --emulate PROFILE|FILE")
    shape = vars(args).get("model.model_shape") or getattr(args, "model_shape", None)
    client_ms = getattr(args, "client_ms", None)
    if client_ms is not None and (client_ms < 0 or calibration):
        raise SystemExit("pdserve simulate: --client-ms is an analytic profile's assumption "
                         "(>= 0 ms); a calibration measured its own (pdserve calibrate "
                         "--client-ms)")
    return cost_model(calibration, analytic, shape, args.analytic_dtype,
                      None if client_ms is None else {"client_s": client_ms / 1000})


def _on_command_line() -> bool:
    """This process is `pdserve simulate ...` itself (not a caller of run_simulate_cmd)."""
    return sys.argv[1:2] == ["simulate"] and Path(sys.argv[0]).name in ("pdserve", "cli.py")


def run_simulate_cmd(args: argparse.Namespace) -> int:
    if _on_command_line():  # it may run again on the compiled build
        error = compiled.reexec(args.code, ["cluster.cli", *sys.argv[1:]])
    else:
        error = "needs the command line" if args.code == "compiled" else None
    if error:
        print(f"pdserve simulate: --code compiled: {error}", file=sys.stderr)
        return 2
    return _simulate(args)


def _simulate(args: argparse.Namespace) -> int:
    from bench.metrics import parse_slo
    from bench.workload import build_workload, describe_workload, summarize_workload
    from cluster.config.flags import config_from_args
    from engine.costs.calibration import CalibrationError
    from sim.cluster import Simulation

    try:
        slos = parse_slo(args.slo)
        cfg = config_from_args(args)
        costs = load_cost_model(args)
        opts = _sim_options(args, trace=bool(args.trace_out))
        sim = Simulation(cfg, costs, opts)
        model = costs.calibration.get("model")
        spec = replace(workload_spec(args, model["vocab_size"], sim.plan.max_model_len),
                       id_prefix="sim-")
        requests = build_workload(spec)
    except (ValueError, OSError) as e:  # CalibrationError is a ValueError
        kind = "calibration" if isinstance(e, CalibrationError) else "error"
        print(f"pdserve simulate: {kind}: {e}", file=sys.stderr)
        return 2
    summary = summarize_workload(requests)
    print(f"pdserve simulate: {costs.label}", flush=True)
    print(f"pdserve simulate: code: {compiled.running()}", flush=True)
    print(f"pdserve simulate: {cfg.pools.prefill_workers}P/{cfg.pools.decode_workers}D, "
          f"{describe_workload(spec, summary)}", flush=True)
    try:
        result = sim.run(requests)
    except ValueError as e:
        print(f"pdserve simulate: calibration: {e}", file=sys.stderr)
        return 2
    weights = {t.name: t.weight for t in spec.tenants}
    m = result.metrics(slos=slos, long_prompt_threshold=args.long_prompt_threshold,
                       tenant_weights=weights)
    print(m.format("Serving Benchmark Result (simulated)"))
    s = result.summary()
    print(f"simulated {s['simulated_s']:.1f} s in {s['wall_s']:.1f} s of wall time "
          f"({s['speedup_vs_real_time']:.0f}x real time, {s['events']} events)")
    if "analytic" == costs.calibration.kind:
        print("NOTE: analytic, not measured: a roofline of published peak figures")
    errors = sorted({f.error for f in result.flights if f.error})
    for e in errors[:5]:
        print(f"  error: {e}", file=sys.stderr)
    if args.trace_out:
        from sim.trace import write_sim_trace

        path = write_sim_trace(result.events, args.trace_out, costs.label)
        print(f"wrote {path} ({len(result.events)} events, simulated clock)")
    if args.json:
        records = [] if args.no_records else [asdict(r) for r in result.records()]
        out = {"addr": "simulated", "backend": "simulate", "workload": summary,
               "max_concurrency": args.max_concurrency, "metrics": m.to_json_dict(),
               "records": records, "simulation": s,
               "config": cfg.to_dict(), "worker_stats": result.worker_stats}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if m.completed else 1


def run_plan_cmd(args: argparse.Namespace) -> int:
    from bench.metrics import parse_slo
    from bench.workload import build_workload, describe_workload, summarize_workload
    from cluster.config.flags import config_from_args
    from sim.cluster import Simulation
    from sim.plan import format_plan, plan_splits, plan_yaml

    try:
        slos = parse_slo(args.slo)
        chunks = tuple(int(x) for x in args.chunk_sizes.split(",") if x.strip())
        cfg = config_from_args(args)
        costs = load_cost_model(args)
        opts = _sim_options(args)
        model = costs.calibration.get("model")
        max_len = Simulation(cfg, costs, opts).plan.max_model_len  # (the same for each split)
        spec = replace(workload_spec(args, model["vocab_size"], max_len), id_prefix="plan-")
        requests = build_workload(spec)
    except (ValueError, OSError) as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    summary = summarize_workload(requests)
    print(f"pdserve plan: {describe_workload(spec, summary)}; {args.gpus} GPUs", flush=True)
    bar = _progress(args.gpus - 1, max(len(chunks), 1))
    try:
        plan = plan_splits(cfg, costs, opts, requests, args.gpus, slos, chunks,
                           progress=lambda c: bar.set_description(f"simulating {c.name}")
                           or bar.update(1) if bar else None)
    except ValueError as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    finally:
        if bar:
            bar.close()
    print(format_plan(plan))
    if "analytic" == costs.calibration.kind:
        print("NOTE: analytic, not measured: a roofline of published peak figures")
    for o in plan.outcomes:
        for e in o.errors:
            print(f"  {o.candidate.name}: error: {e}", file=sys.stderr)
    print(plan_yaml(plan))
    if args.out_config:
        Path(args.out_config).write_text(plan_yaml(plan, full=True), encoding="utf-8")
        print(f"wrote {args.out_config} (every key; pdserve serve --config {args.out_config})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "gpus": plan.gpus, "slos_ms": plan.slos, "cost_model": plan.label,
            "workload": summary, "candidates": [o.row() for o in plan.outcomes],
            "recommendation": plan.best.row()}, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


def _progress(splits: int, chunks: int):
    """A progress bar over the candidates when tqdm is installed and stderr is a terminal."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=splits * chunks, unit="split", leave=False)


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="calibration file to write (JSON)")
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a HF model directory")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence to cover (default: the model's, at most its limit)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="largest prefill step to cover (default 512)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="largest decode batch to cover (default 64)")
    p.add_argument("--quick", action="store_true", help="a coarse grid (seconds on tiny)")
    p.add_argument("--repeats", type=int, default=None, help="timings per point")
    p.add_argument("--connectors", default="inproc,tcp", help="links to measure")
    p.add_argument("--rpc-ms", type=float, default=None, help="assume this one-way Ray call "
                   "latency instead of measuring it (recorded as assumed)")
    p.add_argument("--client-ms", type=float, default=0.0,
                   help="one-way client <-> router latency to assume (default 0: in-process)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a worker's cores)")
    p.add_argument("--control", action="store_true",
                   help="also measure the control plane (dispatch, token delivery) on a real "
                        "1P1D service at idle (Ray; ~1 min)")
    p.add_argument("--stat", choices=("min", "median"), default="min",
                   help="figure kept of the repeats: min (the machine without interference) "
                        "or median (its cost under the load it has now)")
    p.add_argument("--analytic", metavar="PROFILE", help="write an analytic profile instead "
                   "of measuring (h200, h100, a100)")
    p.add_argument("--model-shape", default="llama-3-8b", help="with --analytic: shape name")
    p.add_argument("--analytic-dtype", default="bfloat16")


def run_calibrate_cmd(args: argparse.Namespace) -> int:
    from engine.costs.calibration import CalibrationError

    try:
        if args.analytic:
            cal = load_cost_model(argparse.Namespace(
                calibration=None, analytic=args.analytic, model_shape=args.model_shape,
                analytic_dtype=args.analytic_dtype)).calibration
            cal.save(args.out)
            print(f"pdserve calibrate: wrote {args.out}: {cal.label}")
            return 0
        from sim.calibrate import calibrate, fit_report

        cal = calibrate(args.model, out=args.out, device=args.device, dtype=args.dtype,
                        backend=args.attention_backend, block_size=args.block_size,
                        max_model_len=args.max_model_len,
                        max_batch_tokens=args.max_num_batched_tokens,
                        max_seqs=args.max_num_seqs, quick=args.quick, repeats=args.repeats,
                        connectors=tuple(c for c in args.connectors.split(",") if c),
                        rpc_ms=args.rpc_ms, client_ms=args.client_ms, threads=args.threads,
                        stat=args.stat)
        if args.control:
            from sim.measure_control import add_control

            cal = add_control(args.out, log=print)
    except (CalibrationError, ValueError, OSError) as e:
        print(f"pdserve calibrate: error: {e}", file=sys.stderr)
        return 2
    print(f"pdserve calibrate: wrote {args.out}: {cal.label} "
          f"({cal.data['workload']['seconds']:.0f} s)")
    for line in fit_report(cal):
        print(line)
    return 0


def _study_context(args: argparse.Namespace):
    """`pdserve study --simulate`'s context maker (sim/study.py loads torch: only when asked)."""
    from sim.study import sim_context_factory

    return sim_context_factory(args)


register_simulator(_study_context)


def advise_splits(window, serve_config: dict) -> list:
    """The live planner's advisor: sim/plan.py advise_splits, imported when first asked
    (the simulator's imports stay out of `pdserve`'s start-up; picklable by name for the
    planner's own process)."""
    from sim.plan import advise_splits as advise

    return advise(window, serve_config)


def _register_planner() -> None:
    """`pdserve serve --planner` asks the simulator."""
    from cluster.serve.planner import register_advisor

    register_advisor(advise_splits)


_register_planner()

SUBCOMMANDS = {
    "simulate": ("simulate a cluster on a calibrated cost model (bench's flags and output)",
                 add_simulate_args, run_simulate_cmd),
    "calibrate": ("measure this machine for `pdserve simulate` (or write an analytic profile)",
                  add_calibrate_args, run_calibrate_cmd),
    "plan": ("the P:D split (and prefill chunk) of N GPUs that serves a workload best, asked "
             "of the simulator", add_plan_args, run_plan_cmd),
}
