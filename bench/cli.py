"""The bench's command line: `pdserve bench` and `pdserve study`, plugged into
cluster/cli.py through ``SUBCOMMANDS`` (`make bench` runs `pdserve study all --quick`).

    pdserve bench --addr 127.0.0.1:50051 --num-prompts 200 --request-rate 4 \\
        --mix mixed --max-concurrency 32 --slo ttft:500,tpot:50 --json out.json
    pdserve study chunk-size --out results/ --quick --transfer-compute-ratio 0.15
    pdserve study all --out bench/results --quick            # make bench
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.workload_args import add_workload_args, workload_spec

DEFAULT_ADDR = "127.0.0.1:50051"


# ---- pdserve bench ------------------------------------------------------------------
def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="front door: grpc (pdserve.v1.Generation) or openai (the HTTP API's "
                   "/v1/completions, --http-port) (default grpc)")
    p.add_argument("--addr", default=DEFAULT_ADDR, help="server HOST:PORT of the chosen front "
                   f"door (default {DEFAULT_ADDR})")
    p.add_argument("--base-url", help="openai: the API's base URL (default http://ADDR/v1)")
    p.add_argument("--token-file", help="file with the bearer token (server.auth_token_file)")
    p.add_argument("--tls-ca", help="PEM CA/certificate to trust: connect with TLS")
    p.add_argument("--timeout", type=float, default=None, help="per-request RPC deadline (s)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight; later arrivals wait (default: unlimited)")
    p.add_argument("--slo", default="", help="goodput SLOs in ms, e.g. ttft:500,tpot:50")
    p.add_argument("--long-prompt-threshold", type=int, default=1024,
                   help="prompts longer than this are 'long' for the short-TTFT line")
    p.add_argument("--json", metavar="OUT", help="write metrics, workload and records here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_workload_args(p)
    from bench.emulated import add_emulate_args

    add_emulate_args(p)


def run_bench_cmd(args: argparse.Namespace) -> int:
    import asyncio
    from dataclasses import asdict

    import grpc

    from bench.client import run_bench, server_model_info
    from bench.emulated import device_report, device_snapshot, emulate_label, format_report
    from bench.metrics import compute_metrics, parse_slo
    from bench.workload import build_workload, describe_workload, summarize_workload
    from cluster.grpc.auth import read_token

    try:
        slos = parse_slo(args.slo)
    except ValueError as e:
        print(f"pdserve bench: error: --slo: {e}", file=sys.stderr)
        return 2
    import openai

    token = read_token(args.token_file) if args.token_file else None
    target = args.addr if args.backend == "grpc" else (args.base_url or f"http://{args.addr}/v1")
    try:
        vocab, max_len = asyncio.run(server_model_info(target, token=token,
                                                       tls_ca=args.tls_ca, backend=args.backend))
        spec = workload_spec(args, vocab, max_len)
        requests = build_workload(spec)
        label = emulate_label(args)
        snapshot = (lambda: asyncio.run(device_snapshot(target, token=token, tls_ca=args.tls_ca))
                    ) if args.backend == "grpc" else dict
        devices_before = snapshot()
    except grpc.RpcError as e:
        print(f"pdserve bench: error: {args.addr}: {e.code().name}: {e.details()}",
              file=sys.stderr)
        return 1
    except openai.APIError as e:
        print(f"pdserve bench: error: {target}: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    summary = summarize_workload(requests)
    print(f"pdserve bench: {target} ({args.backend}): {describe_workload(spec, summary)}",
          flush=True)
    run = asyncio.run(run_bench(target, requests, max_concurrency=args.max_concurrency,
                                token=token, tls_ca=args.tls_ca, timeout=args.timeout,
                                progress=not args.no_progress, backend=args.backend))
    weights = {t.name: t.weight for t in spec.tenants}
    m = compute_metrics(run.records, run.duration_s, slos=slos,
                        long_prompt_threshold=args.long_prompt_threshold,
                        tenant_weights=weights)
    devices = device_report(devices_before, snapshot()) if devices_before else {}
    print(m.format() if label is None else f"{label}\n{m.format()}")
    if devices:
        print(format_report(devices, label, m.total_output_tokens))
    errors = sorted({r.error for r in run.records if r.error})
    for e in errors[:5]:
        print(f"  error: {e}", file=sys.stderr)
    if args.json:
        out = {"addr": target, "backend": args.backend, "workload": summary, "max_concurrency": args.max_concurrency,
               "metrics": m.to_json_dict(), "records": [asdict(r) for r in run.records],
               "emulated": {"label": label, "devices": devices} if label or devices else None}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if m.completed else 1


# ---- pdserve study ------------------------------------------------------------------
def add_study_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--quick", action="store_true",
                   help="a couple of configurations and a few requests per study")
    p.add_argument("--model", default="tiny", help="tiny, small or a HF model directory")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--link-gbps", type=float, help="emulated KV link rate in Gbit/s")
    link.add_argument("--transfer-compute-ratio", type=float, default=0.15,
                      help="emulate the link so a reference prompt's KV transfer takes R x "
                      "its prefill time (default 0.15: H200 + InfiniBand-like)")
    p.add_argument("--transport", choices=("inproc", "grpc"), default="inproc",
                   help="drive each configuration in-process (default) or over its gRPC port")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--configs", default="", help="comma-separated configuration names to run")
    p.add_argument("--num-requests", type=int, default=None, help="override request counts")
    p.add_argument("--slo", default="", help="goodput SLOs in ms (default ttft:2000,tpot:200; "
                   "with --emulate ttft:250,tpot:25)")
    p.add_argument("--no-trace", action="store_true", help="do not record worker traces")
    from cluster.config.flags import _weights

    p.add_argument("--tenant-weights", default=None, metavar="NAME=W,...", type=_weights,
                   help="tenant weights of every configuration (scheduler.tenant_weights: "
                   "the prefill policy, the KV send queue and decode admission); the "
                   "fairness study's tenants (default gold=2,free=1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--log-level", default="warning", help="log level (default warning)")
    g = p.add_argument_group("simulate (sim/study.py): the sweeps at cluster scale")
    g.add_argument("--simulate", action="store_true",
                   help="run the configurations in the simulator instead of launching them")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--calibration", help="a calibration file from `pdserve calibrate`")
    src.add_argument("--analytic", help="an analytic profile (h200, h100, a100): labelled "
                     "'analytic, not measured'")
    g.add_argument("--model-shape", default="llama-3-8b", help="with --analytic or --emulate")
    p.add_argument("--emulate", metavar="PROFILE|FILE", help="run the configurations' real "
                   "services on an emulated accelerator (as `pdserve serve --emulate`) of "
                   "--model-shape: results labelled 'emulated <profile>, <shape>: analytic, "
                   "not measured'")
    p.add_argument("--emulate-kv-fraction", type=float, default=1.0,
                   help="with --emulate: the share of each chunk's KV bytes the prefill "
                   "workers send, the link charged in full (as `pdserve serve "
                   "--emulate-kv-fraction`; labelled), where this host's copies would set "
                   "the pace (default 1)")
    g.add_argument("--analytic-dtype", default="bfloat16", help="with --analytic")
    g.add_argument("--prefill-workers", type=int, default=8, help="simulated prefill pool")
    g.add_argument("--decode-workers", type=int, default=24, help="simulated decode pool")
    g.add_argument("--load-scale", type=float, default=8.0,
                   help="each study's request count and rate times this (default 8)")
    g.add_argument("--interconnect", help="link cost entry of the cost model (default: the "
                   "connector)")
    g.add_argument("--decode-order", default="least-legs",
                   help="decode order (cluster/router/policies.py; default least-legs)")


def study_options(args: argparse.Namespace):
    from bench.metrics import parse_slo
    from bench.studies.context import DEFAULT_SLOS, EMULATED_SLOS, StudyOptions

    emulate = getattr(args, "emulate", None)
    label = None
    if emulate:
        from engine.config import EmulateConfig

        label = EmulateConfig(emulate, args.model_shape, args.emulate_kv_fraction).label
    elif args.emulate_kv_fraction != 1.0:
        raise ValueError("--emulate-kv-fraction needs --emulate")
    return StudyOptions(
        out=args.out, quick=args.quick, model=label or args.model, link_gbps=args.link_gbps,
        emulate=emulate, model_shape=args.model_shape if emulate else None,
        emulate_kv_fraction=args.emulate_kv_fraction if emulate else 1.0,
        transfer_compute_ratio=args.transfer_compute_ratio, transport=args.transport,
        seed=args.seed, trace=not args.no_trace, progress=not args.no_progress,
        slos=parse_slo(args.slo) if args.slo else dict(EMULATED_SLOS if emulate
                                                       else DEFAULT_SLOS),
        configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()),
        num_requests=args.num_requests,
        **({"tenant_weights": args.tenant_weights} if args.tenant_weights else {}))


def add_study_args(p: argparse.ArgumentParser) -> None:
    from bench.study import ORDER, STUDIES

    p.add_argument("name", choices=(*STUDIES, "all"), help="the study to run ('all': every "
                   "one, then an index OUT/README.md)")
    add_study_options(p)
    p.add_argument("--studies", default=",".join(ORDER),
                   help=f"with 'all': a comma-separated subset of {','.join(ORDER)}")


# `pdserve study --simulate` runs a study in the simulator, a layer above bench: sim/cli.py
# registers its context maker (args -> (StudyOptions -> StudyContext)) when it is loaded
SIMULATOR: Callable[[argparse.Namespace], Callable[..., Any]] | None = None


def register_simulator(make_factory: Callable[[argparse.Namespace], Callable[..., Any]]) -> None:
    global SIMULATOR
    SIMULATOR = make_factory


def run_study_cmd(args: argparse.Namespace) -> int:
    import logging

    from bench.study import ORDER, run_all, run_study

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    studies = tuple(s.strip() for s in args.studies.split(",") if s.strip())
    if args.name == "all" and args.configs:
        return _study_error("--configs picks configurations of one study: use "
                            "`pdserve study NAME`")
    if unknown := sorted(set(studies) - set(ORDER)):
        return _study_error(f"--studies: unknown {unknown}")
    try:
        opts = study_options(args)
    except ValueError as e:
        return _study_error(str(e))
    factory = None
    try:
        if args.simulate or args.calibration or args.analytic:
            if SIMULATOR is None:
                return _study_error("--simulate needs the simulator (sim/cli.py registers it "
                                    "when `pdserve` loads its plug-ins)")
            factory = SIMULATOR(args)
    except ValueError as e:
        return _study_error(str(e))
    if args.name == "all":
        return run_all(opts, studies, factory)
    from bench.studies.context import StudyContext

    print(f"pdserve study {args.name}: {opts.summary()}", flush=True)
    try:
        ctx = factory(opts) if factory else StudyContext(opts)
    except ValueError as e:
        return _study_error(str(e))
    print(f"   runs: {ctx.describe()}", flush=True)
    try:
        run_study(args.name, ctx)
    except ValueError as e:
        return _study_error(str(e))
    finally:
        ctx.close()
    return 0


def _study_error(message: str) -> int:
    print(f"pdserve study: error: {message}", file=sys.stderr)
    return 2


def study_main(argv: list[str] | None = None, prog: str = "pdserve study",
               description: str = "run a parameter study") -> int:
    """`pdserve study ...` without the rest of the pdserve CLI."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_args(p)
    return run_study_cmd(p.parse_args(argv))


SUBCOMMANDS = {
    "bench": ("run a workload against a running server (vllm bench serve style)",
              add_bench_args, run_bench_cmd),
    "study": ("run a parameter study (launches the service per configuration)",
              add_study_args, run_study_cmd),
}
