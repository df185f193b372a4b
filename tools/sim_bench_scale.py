"""How fast the simulator runs a cluster-scale trace, against real time.

    python -m tools.sim_bench_scale                      # 1 hour at 100 req/s on 8P/24D
    python -m tools.sim_bench_scale --duration 60 --compare-exact 20

The default is the issue's target: a 1-hour chat trace at 100 req/s on 8 prefill and 24
decode workers of an analytic H200 serving an 8B-shape model. It prints the simulated
span, the wall-clock and CPU time of the event loop and their ratio to real time (the
machine is shared: CPU time is the steadier figure), the events per second, the time to
build the workload and to compute the metrics, and the run's headline metrics.
``--compare-exact S`` also simulates the first S seconds with the decode scheduler run
at every step (the baseline fast stepping replaces) and prints both speeds and the ratio.
``--policy-share`` profiles the run (cProfile) and prints how its time splits between
pdserve's real policy code (engine/, prefill_worker/, decode_worker/, kv_transfer/,
cluster/; a builtin's time goes to its caller's side) and the simulator's own code: the
speed-up the run could reach if the simulator's own code cost nothing (measured on the
interpreted code: a profile sees nothing inside compiled modules).
``--code``: run on the compiled build of `make sim-fast` (sim/compiled.py) when it is
there and matches the source (auto, the default), insist on it, or not; the output says
which code ran.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from sim import compiled


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.sim_bench_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=3600.0, help="trace length in seconds")
    p.add_argument("--rate", type=float, default=100.0, help="requests per second")
    p.add_argument("--prefill", type=int, default=8, help="prefill workers")
    p.add_argument("--decode", type=int, default=24, help="decode workers")
    p.add_argument("--mix", default="chat", help="workload mix (bench/workload.py)")
    p.add_argument("--profile", default="h200", help="analytic hardware profile")
    p.add_argument("--model-shape", default="llama-3-8b")
    p.add_argument("--interconnect", default="infiniband")
    p.add_argument("--decode-order", default="least-legs",
                   help="least-legs (router-side counts) or least-kv-usage (today's router)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="cache.enable_prefix_caching (the BlockManager hashes every block)")
    p.add_argument("--compare-exact", type=float, default=0.0, metavar="S",
                   help="also run S seconds with exact decode stepping, print the ratio")
    p.add_argument("--policy-share", action="store_true",
                   help="profile the run: the share of its time in the real policy code")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--code", choices=compiled.CODES, default="auto",
                   help="the compiled build of `make sim-fast` (auto: when present and "
                   "current; --policy-share: interpreted) or the source")
    return p.parse_args(argv)


POLICY_DIRS = ("engine/", "prefill_worker/", "decode_worker/", "kv_transfer/", "cluster/")


def policy_share(stats, root: str) -> dict[str, float]:
    """Seconds of a ``pstats.Stats`` by side: the real policy code, the simulator, other."""
    def side(path: str) -> str:
        rel = path[len(root):] if path.startswith(root) else path
        return ("policy" if rel.startswith(POLICY_DIRS) else
                "simulator" if rel.startswith("sim/") else "other")

    out = {"policy": 0.0, "simulator": 0.0, "other": 0.0}
    for (path, _, _), (_, _, own, _, callers) in stats.stats.items():
        if path == "~":  # a builtin: its time goes to the side of whoever called it
            for (cpath, _, _), (_, _, t, _) in callers.items():
                out[side(cpath)] += t
        else:
            out[side(path)] += own
    return out


def simulate(args: argparse.Namespace, duration: float, stepping: str) -> dict:
    from bench.workload import WorkloadSpec, build_workload
    from engine.costs.analytic import analytic_calibration
    from engine.costs.loader import load_costs
    from sim.adapters import ServeConfig
    from sim.cluster import Simulation
    from sim.options import SimOptions

    costs = load_costs(analytic_calibration(args.profile, args.model_shape))
    cfg = ServeConfig().with_values({
        "pools.prefill_workers": args.prefill, "pools.decode_workers": args.decode,
        "model.max_model_len": 4096, "cache.enable_prefix_caching": args.prefix_caching})
    t0 = time.perf_counter()
    spec = WorkloadSpec(num_requests=max(1, round(args.rate * duration)),
                        request_rate=args.rate, mix=args.mix, seed=args.seed,
                        vocab_range=(1, 32000), id_prefix="r")
    requests = build_workload(spec)
    build_s = time.perf_counter() - t0
    sim = Simulation(cfg, costs, SimOptions(interconnect=args.interconnect,
                                            decode_order=args.decode_order,
                                            decode_stepping=stepping))
    gc.collect()
    gc.freeze()  # the workload is long-lived: keep the collector off it
    profiler = None
    if getattr(args, "policy_share", False):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    c0, w0 = time.process_time(), time.perf_counter()
    result = sim.run(requests)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if profiler is not None:
        import os
        import pstats

        profiler.disable()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
        share = policy_share(pstats.Stats(profiler), root)
        total = sum(share.values())
        print("profiled: " + ", ".join(f"{k} {v / total:.0%} ({v * 1e6 / len(requests):.0f} "
                                       "us per request, profiled)" for k, v in share.items())
              + f"; if the simulator's own code cost nothing: x"
              f"{total / (total - share['simulator']):.2f} faster")
    t1 = time.perf_counter()
    m = result.metrics(exact=False)
    metrics_s = time.perf_counter() - t1
    gc.unfreeze()
    return {"requests": len(requests), "simulated_s": result.simulated_s, "wall_s": wall,
            "cpu_s": cpu, "events": result.events_run, "build_s": build_s,
            "metrics_s": metrics_s, "metrics": m, "label": costs.label,
            "preemptions": sum(f.preemptions for f in result.flights)}


def report(name: str, r: dict) -> None:
    sim_s = r["simulated_s"]
    print(f"{name}: {r['requests']} requests, {sim_s:.0f} s simulated in {r['wall_s']:.1f} s "
          f"wall ({sim_s / r['wall_s']:.0f}x real time) / {r['cpu_s']:.1f} s CPU "
          f"({sim_s / r['cpu_s']:.0f}x); {r['events']} events "
          f"({r['events'] / r['cpu_s']:.0f}/s CPU); workload built in {r['build_s']:.1f} s, "
          f"metrics in {r['metrics_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    code = "interpreted" if args.policy_share and args.code == "auto" else args.code
    if argv is None:  # the command line: it may run again on the compiled build
        error = compiled.reexec(code, ["tools.sim_bench_scale", *sys.argv[1:]])
        if error:
            print(f"bench_scale: --code compiled: {error}", file=sys.stderr)
            return 2
    elif code == "compiled":
        print("bench_scale: --code compiled needs the command line", file=sys.stderr)
        return 2
    print(f"bench_scale: {args.duration:g} s at {args.rate:g} req/s, {args.prefill}P/"
          f"{args.decode}D, mix {args.mix}, prefix caching "
          f"{'on' if args.prefix_caching else 'off'}, decode order {args.decode_order}; "
          f"code: {compiled.running()}")
    fast = simulate(args, args.duration, "fast")
    print(f"cost model: {fast['label']}")
    report("fast stepping", fast)
    m = fast["metrics"]
    print(f"  completed {m.completed}, failed {m.failed}, preemptions {fast['preemptions']}; "
          f"TTFT p50 {m.ttft.median * 1e3:.1f} ms p99 {m.ttft.percentiles[99.0] * 1e3:.1f} ms; "
          f"ITL p50 {m.itl.median * 1e3:.2f} ms p99 {m.itl.percentiles[99.0] * 1e3:.2f} ms")
    if args.compare_exact:
        head = simulate(args, args.compare_exact, "fast")
        exact = simulate(args, args.compare_exact, "exact")
        report(f"first {args.compare_exact:g} s, fast", head)
        report(f"first {args.compare_exact:g} s, exact", exact)
        print(f"  fast / exact speed: {exact['cpu_s'] / head['cpu_s']:.2f}x (CPU time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
