"""`pdserve soak`: the chaos/soak harness (bench/soak.py) as a subcommand, plugged into
cluster/cli.py through ``SUBCOMMANDS``.

    pdserve soak --addr HOST:PORT --requests 1000 --rate 8 --cancel-rate 0.3 \\
        --kill-every 30 --ray-address auto --model tiny --json soak.json

Exit status: 0 when every check passed, 1 on any leak, hang, token mismatch, bad
terminal status or worker that did not come back, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import sys


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default="127.0.0.1:50051", help="server HOST:PORT")
    p.add_argument("--requests", type=int, default=1000, help="requests to send (default 1000)")
    p.add_argument("--rate", type=float, default=8.0, help="arrivals per second (Poisson)")
    p.add_argument("--cancel-rate", type=float, default=0.3,
                   help="share of streams cancelled (phases queued/prefill/transfer/decode "
                   "take turns)")
    p.add_argument("--kill-every", type=float, default=None, metavar="S",
                   help="kill a random prefill or decode worker actor every S seconds "
                   "(after the previous one is back); needs Ray access")
    p.add_argument("--max-kills", type=int, default=None,
                   help="kill exactly this many times (the run waits for them after the "
                   "traffic ends); default: keep killing while traffic runs")
    p.add_argument("--kill-roles", default="decode,prefill",
                   help="pools to kill from, in turn (default decode,prefill)")
    p.add_argument("--max-restarts", type=int, default=2,
                   help="kills per actor at most (the service's pools.max_restarts)")
    p.add_argument("--ray-address", default="auto",
                   help="Ray cluster of the service ('auto' on a cluster node, or ray://HOST:10001)")
    p.add_argument("--actor-tag", default=None,
                   help="service tag (pdserve-xxxxxx) when the Ray cluster runs several")
    p.add_argument("--model", default=None,
                   help="the service's model dir (or 'tiny'): compare greedy tokens with engine.LLM")
    p.add_argument("--metrics-url", default=None, help="e.g. http://HOST:9090/metrics")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds a request may take before it counts as a hang")
    p.add_argument("--quiesce-timeout", type=float, default=120.0,
                   help="seconds to wait for the service to go idle at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default="0.6,0.2,0.2",
                   help="weights of chat, long-document and shared-prefix requests")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    p.add_argument("--token-file", help="file with the bearer token")
    p.add_argument("--tls-ca", help="PEM CA/certificate to trust: connect with TLS")
    p.add_argument("--json", default=None, help="write the full report (every request) here")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: on when stderr is a terminal)")


def config_from_args(args: argparse.Namespace):
    from bench.soak import SoakConfig

    token = None
    if args.token_file:
        from cluster.auth import read_token

        token = read_token(args.token_file)
    mix = tuple(float(x) for x in args.mix.split(","))
    return SoakConfig(
        addr=args.addr, requests=args.requests, rate=args.rate, cancel_rate=args.cancel_rate,
        kill_every_s=args.kill_every, max_kills=args.max_kills,
        kill_roles=tuple(r.strip() for r in args.kill_roles.split(",") if r.strip()),
        max_restarts=args.max_restarts, ray_address=args.ray_address,
        actor_tag=args.actor_tag, model=args.model, metrics_url=args.metrics_url,
        deadline_s=args.deadline, quiesce_timeout_s=args.quiesce_timeout, seed=args.seed,
        mix=mix, prompt_scale=args.prompt_scale, output_scale=args.output_scale,
        token=token, tls_ca=args.tls_ca, progress=sys.stderr.isatty() if args.progress is None else args.progress)


def run_soak_cmd(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from bench.soak import run_soak

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"pdserve soak: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        report = asyncio.run(run_soak(cfg))
    except (ConnectionError, RuntimeError, ValueError) as e:  # e.g. Ray unreachable
        print(f"pdserve soak: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        report.write(args.json)
        print(f"report: {args.json}")
    return 0 if report.ok else 1


SUBCOMMANDS = {
    "soak": ("chaos/soak test a running service: cancels, worker kills, leak and "
             "exactness checks", add_soak_args, run_soak_cmd),
}
