"""`pdserve soak`: the chaos/soak harness (bench/soak.py) as a subcommand, plugged into
cluster/cli.py through ``SUBCOMMANDS``.

    pdserve soak --addr HOST:PORT --requests 1000 --rate 8 --cancel-rate 0.3 \\
        --kill-every 30 --ray-address auto --model tiny --json soak.json
    pdserve soak --pressure --requests 1000 --model tiny --json pressure.json

``--pressure`` without ``--addr`` runs its own small-pool service (bench/soak_service.py,
which also documents the serve flags for running one yourself) and drains it at the end.

Exit status: 0 when every check passed, 1 on any leak, hang, token mismatch, bad
terminal status or worker that did not come back, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import sys


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=None,
                   help="server HOST:PORT (default 127.0.0.1:50051; with --pressure and no "
                   "--addr the soak runs its own small-pool service)")
    p.add_argument("--requests", type=int, default=1000, help="requests to send (default 1000)")
    p.add_argument("--rate", type=float, default=None,
                   help="arrivals per second (Poisson; default 8, with --pressure 3)")
    p.add_argument("--cancel-rate", type=float, default=None,
                   help="share of streams cancelled (phases queued/prefill/transfer/decode "
                   "take turns; default 0.3, with --pressure 0.1)")
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
    p.add_argument("--emulate", metavar="PROFILE|FILE", default=None,
                   help="the service runs on an emulated accelerator (its --emulate): "
                   "compare greedy tokens with engine.LLM on the same emulated device")
    p.add_argument("--model-shape", default=None, help="with --emulate: the service's shape")
    p.add_argument("--metrics-url", default=None, help="e.g. http://HOST:9090/metrics")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds a request may take before it counts as a hang")
    p.add_argument("--quiesce-timeout", type=float, default=120.0,
                   help="seconds to wait for the service to go idle at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", default=None,
                   help="weights of chat, long-document and shared-prefix requests "
                   "(default 0.6,0.2,0.2, with --pressure 0.3,0.2,0.5)")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    p.add_argument("--token-file", help="file with the bearer token")
    p.add_argument("--tls-ca", help="PEM CA/certificate to trust: connect with TLS")
    p.add_argument("--json", default=None, help="write the full report (every request) here")
    g = p.add_argument_group("pressure (--pressure)")
    g.add_argument("--pressure", action="store_true",
                   help="requests sized to fill KV pools that hold 2-3 of them, shared "
                   "prefixes, Abort RPCs at every phase, client deadlines, reused ids, "
                   "preemption storms and a drain")
    g.add_argument("--abort-rate", type=float, default=None,
                   help="share aborted with the Abort RPC (default 0.25 with --pressure)")
    g.add_argument("--client-deadline-rate", type=float, default=None,
                   help="share sent with a client deadline, half of 5-100 ms, half of 0.3-3 s "
                   "(default 0.1 with --pressure)")
    g.add_argument("--reuse-rate", type=float, default=None,
                   help="share reusing an ended request's id (default 0.1 with --pressure)")
    g.add_argument("--drain", action=argparse.BooleanOptionalAction, default=None,
                   help="drain the service near the end (default: on when the soak runs it)")
    g.add_argument("--pool-blocks", type=int, default=24,
                   help="KV blocks per worker of the service the soak runs (default 24)")
    g.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    g.add_argument("--pool-tokens", type=int, default=None,
                   help="size requests for pools of this many tokens (default: from GetStats)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: on when stderr is a terminal)")


def config_from_args(args: argparse.Namespace):
    from bench.soak import SoakConfig

    token = None
    if args.token_file:
        from cluster.grpc.auth import read_token

        token = read_token(args.token_file)
    pressure, own = args.pressure, args.pressure and args.addr is None
    pick = lambda v, plain, press: v if v is not None else (press if pressure else plain)  # noqa: E731
    mix = tuple(float(x) for x in pick(args.mix, "0.6,0.2,0.2", "0.3,0.2,0.5").split(","))
    return SoakConfig(
        addr=args.addr or "127.0.0.1:50051", requests=args.requests,
        rate=pick(args.rate, 8.0, 3.0), cancel_rate=pick(args.cancel_rate, 0.3, 0.1),
        kill_every_s=args.kill_every, max_kills=args.max_kills,
        kill_roles=tuple(r.strip() for r in args.kill_roles.split(",") if r.strip()),
        max_restarts=args.max_restarts, ray_address=args.ray_address,
        actor_tag=args.actor_tag, model=args.model, metrics_url=args.metrics_url,
        emulate=args.emulate, model_shape=args.model_shape,
        deadline_s=args.deadline, quiesce_timeout_s=args.quiesce_timeout, seed=args.seed,
        mix=mix, prompt_scale=args.prompt_scale, output_scale=args.output_scale,
        token=token, tls_ca=args.tls_ca,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
        pressure=pressure, pool_tokens=args.pool_tokens, block_size=args.block_size,
        abort_rate=pick(args.abort_rate, 0.0, 0.25),
        client_deadline_rate=pick(args.client_deadline_rate, 0.0, 0.1),
        reuse_rate=pick(args.reuse_rate, 0.0, 0.1),
        drain=own if args.drain is None else args.drain)


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
        if cfg.pressure and args.addr is None:
            report = _run_own_service(cfg, args)
        else:
            report = asyncio.run(run_soak(cfg))
    except (ConnectionError, RuntimeError, ValueError) as e:  # e.g. Ray unreachable
        print(f"pdserve soak: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        report.write(args.json)
        print(f"report: {args.json}")
    return 0 if report.ok else 1


def _run_own_service(cfg, args: argparse.Namespace):
    """--pressure without --addr: start the small-pool service here, soak it, stop it."""
    import asyncio
    import dataclasses

    from bench.soak import run_soak
    from bench.soak_service import PressureService, PressureServiceSpec

    spec = PressureServiceSpec(model=args.model or "tiny", num_blocks=args.pool_blocks,
                               block_size=args.block_size, drain_timeout_s=cfg.deadline_s)
    print(f"pdserve soak: starting a service with {spec.num_blocks} x {spec.block_size}-token "
          "KV blocks per worker", file=sys.stderr)
    with PressureService(spec) as svc:
        run = dataclasses.replace(cfg, addr=svc.addr, model=cfg.model or spec.model,
                                  ray_address=None)
        return asyncio.run(run_soak(run, hooks=svc.hooks()))


SUBCOMMANDS = {
    "soak": ("chaos/soak test a running service: cancels, worker kills, leak and "
             "exactness checks", add_soak_args, run_soak_cmd),
}
