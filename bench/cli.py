"""`pdserve bench` and `pdserve study`, plugged into cluster/cli.py through ``SUBCOMMANDS``.

    pdserve bench --addr 127.0.0.1:50051 --num-prompts 200 --request-rate 4 \\
        --mix mixed --max-concurrency 32 --slo ttft:500,tpot:50 --json out.json
    pdserve study chunk-size --out results/ --quick --transfer-compute-ratio 0.15
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
from pathlib import Path

from bench.workload import MIXES

DEFAULT_ADDR = "127.0.0.1:50051"


# ---- workload flags -----------------------------------------------------------------
def parse_length(text: str):
    """``128`` (fixed), ``64:256`` (uniform), ``lognormal:MEDIAN:SIGMA[:LO:HI]``."""
    from bench.workload import LengthDist

    parts = text.split(":")
    try:
        if parts[0] == "lognormal" and len(parts) in (3, 5):
            lo, hi = (int(parts[3]), int(parts[4])) if len(parts) == 5 else (1, 1 << 20)
            return LengthDist.lognormal(float(parts[1]), float(parts[2]), lo, hi)
        if len(parts) == 1:
            return LengthDist.fixed(int(parts[0]))
        if len(parts) == 2:
            return LengthDist.uniform(int(parts[0]), int(parts[1]))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected N, LO:HI or lognormal:MEDIAN:SIGMA[:LO:HI]")


def parse_tenants(text: str):
    """``gold:0.3:4[:500],free:0.7:1`` = name:share:weight[:ttft_deadline_ms], ..."""
    from bench.workload import TenantSpec

    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        if not 1 <= len(parts) <= 4:
            raise argparse.ArgumentTypeError(f"tenant {item!r}: name:share:weight[:deadline]")
        try:
            nums = [float(x) for x in parts[1:]]
            out.append(TenantSpec(parts[0], *nums[:2], ttft_deadline_ms=(
                nums[2] if len(nums) > 2 else None)))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"tenant {item!r}: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError("--tenants needs at least one tenant")
    return tuple(out)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests/s; inf sends all at once (default inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier")
    g.add_argument("--mix", choices=MIXES, default="chat", help="workload mix (default chat)")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    g.add_argument("--prompt-len", type=parse_length, help="prompt lengths: N, LO:HI or "
                   "lognormal:MEDIAN:SIGMA[:LO:HI] (default: the mix's)")
    g.add_argument("--output-len", type=parse_length, help="output lengths (same forms)")
    g.add_argument("--long-prompt-len", type=parse_length, help="mixed: long prompt lengths")
    g.add_argument("--long-output-len", type=parse_length, help="mixed: long output lengths")
    g.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long prompts")
    g.add_argument("--num-prefix-groups", type=int, default=4, help="shared-prefix: groups")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: prefix tokens")
    g.add_argument("--tenants", type=parse_tenants,
                   help="name:share:weight[:ttft_deadline_ms],... (default one tenant)")
    g.add_argument("--scale", type=float, default=1.0, help="multiply every length by this")
    g.add_argument("--dataset-path", help="sharegpt: the ShareGPT JSON file")


def workload_spec(args: argparse.Namespace, vocab_size: int, max_model_len: int):
    from bench.workload import TenantSpec, WorkloadSpec

    return WorkloadSpec(
        num_requests=args.num_prompts, request_rate=args.request_rate,
        burstiness=args.burstiness, mix=args.mix, seed=args.seed,
        vocab_range=(1, vocab_size), prompt_len=args.prompt_len, output_len=args.output_len,
        long_prompt_len=args.long_prompt_len, long_output_len=args.long_output_len,
        long_fraction=args.long_fraction, num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len, tenants=args.tenants or (TenantSpec("default"),),
        scale=args.scale, max_model_len=max_model_len, dataset_path=args.dataset_path,
        id_prefix=f"bench-{secrets.token_hex(3)}-")


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


def run_bench_cmd(args: argparse.Namespace) -> int:
    import asyncio
    from dataclasses import asdict

    import grpc

    from bench.client import run_bench, server_model_info
    from bench.metrics import compute_metrics, parse_slo
    from bench.workload import build_workload, summarize_workload
    from cluster.auth import read_token

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
    print(f"pdserve bench: {target} ({args.backend}): {summary['num_requests']} requests, "
          f"mix {spec.mix}, "
          f"rate {spec.request_rate:g}/s, prompt mean {summary['prompt_len']['mean']:.0f}, "
          f"output mean {summary['max_tokens']['mean']:.0f}", flush=True)
    run = asyncio.run(run_bench(target, requests, max_concurrency=args.max_concurrency,
                                token=token, tls_ca=args.tls_ca, timeout=args.timeout,
                                progress=not args.no_progress, backend=args.backend))
    weights = {t.name: t.weight for t in spec.tenants}
    m = compute_metrics(run.records, run.duration_s, slos=slos,
                        long_prompt_threshold=args.long_prompt_threshold,
                        tenant_weights=weights)
    print(m.format())
    errors = sorted({r.error for r in run.records if r.error})
    for e in errors[:5]:
        print(f"  error: {e}", file=sys.stderr)
    if args.json:
        out = {"addr": target, "backend": args.backend, "workload": summary, "max_concurrency": args.max_concurrency,
               "metrics": m.to_json_dict(), "records": [asdict(r) for r in run.records]}
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
    p.add_argument("--slo", default="", help="goodput SLOs in ms (default ttft:2000,tpot:200)")
    p.add_argument("--no-trace", action="store_true", help="do not record worker traces")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--log-level", default="warning", help="log level (default warning)")


def study_options(args: argparse.Namespace):
    from bench.metrics import parse_slo
    from bench.studies.common import DEFAULT_SLOS, StudyOptions

    return StudyOptions(
        out=args.out, quick=args.quick, model=args.model, link_gbps=args.link_gbps,
        transfer_compute_ratio=args.transfer_compute_ratio, transport=args.transport,
        seed=args.seed, trace=not args.no_trace, progress=not args.no_progress,
        slos=parse_slo(args.slo) if args.slo else dict(DEFAULT_SLOS),
        configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()),
        num_requests=args.num_requests)


def add_study_args(p: argparse.ArgumentParser) -> None:
    from bench.study import STUDIES

    p.add_argument("name", choices=(*STUDIES, "all"), help="the study to run ('all': every one)")
    add_study_options(p)


def run_study_cmd(args: argparse.Namespace) -> int:
    import logging

    from bench.studies.common import StudyContext
    from bench.study import options_summary, run_study

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = study_options(args)
    except ValueError as e:
        print(f"pdserve study: error: {e}", file=sys.stderr)
        return 2
    if args.name == "all":
        from bench.run_all import run_all

        return run_all(opts)
    print(f"pdserve study {args.name}: {options_summary(opts)}", flush=True)
    ctx = StudyContext(opts)
    try:
        run_study(args.name, ctx)
    except ValueError as e:
        print(f"pdserve study: error: {e}", file=sys.stderr)
        return 2
    finally:
        ctx.close()
    return 0


SUBCOMMANDS = {
    "bench": ("run a workload against a running server (vllm bench serve style)",
              add_bench_args, run_bench_cmd),
    "study": ("run a parameter study (launches the service per configuration)",
              add_study_args, run_study_cmd),
}
