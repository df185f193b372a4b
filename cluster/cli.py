"""`pdserve` command line: serve, generate, stats, make-model, demo (+ optional plug-ins).

Subcommands live in a registry: name -> Subcommand(help, add_args, run). Other packages
add theirs without touching this file by exposing `SUBCOMMANDS = {name: (help, add_args,
run)}` in one of PLUGIN_MODULES (e.g. `bench/cli.py` for `bench`, `study`); a missing
plug-in module is skipped. `run(args) -> int` is the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from cluster.config.flags import add_cli_flags, keys_epilog
from cluster.console import config_or_exit, fail, format_stats, setup_logging
from cluster.serve.startup import (  # noqa: F401  (build_router, launcher_available: re-exported)
    StartupError,
    build_router,
    launcher_available,
    resolve_model,
    startup_errors,
)

PLUGIN_MODULES = ("bench.cli", "bench.soak_cli", "sim.cli")
DEFAULT_ADDR = "127.0.0.1:50051"
log = logging.getLogger("pdserve")


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Subcommand] = {}


def register(name: str, help: str, add_args, run) -> None:
    COMMANDS[name] = Subcommand(help, add_args, run)


def _load_plugins() -> None:
    for module in PLUGIN_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # the plug-in is not installed
            print(f"pdserve: warning: skipping plug-in {module}: {e}", file=sys.stderr)
            continue
        except Exception as e:  # a broken plug-in must not take `pdserve serve` down
            print(f"pdserve: warning: skipping plug-in {module}: {e!r}", file=sys.stderr)
            continue
        for name, (help_, add_args, run) in getattr(mod, "SUBCOMMANDS", {}).items():
            register(name, help_, add_args, run)


# ---- serve --------------------------------------------------------------------------
def _add_serve(p: argparse.ArgumentParser) -> None:
    add_cli_flags(p)


def _run_serve(args: argparse.Namespace) -> int:
    cfg = config_or_exit(args)  # before the heavy imports: a typo fails instantly
    import asyncio

    from cluster.serve.server import serve
    from runtime.event_loop import run as run_loop

    setup_logging(cfg.server.log_level)
    mode = "colocated" if cfg.pools.colocated else "disaggregated"
    async def main() -> None:
        served = resolve_model(cfg)  # 'smollm2' is fetched here on first use
        router = await build_router(served)
        refresher = None
        if cfg.server.metrics_port is not None:
            from cluster.metrics import ServiceMetrics, refresh_loop, serve_metrics_for

            metrics = ServiceMetrics()
            em = cfg.model.emulate_config
            metrics.emulated = em.label if em is not None else None
            if hasattr(router, "metrics"):
                router.metrics = metrics  # latency histograms observed as tokens stream
            url = serve_metrics_for(cfg.server, metrics)  # TLS and token as gRPC's
            refresher = asyncio.ensure_future(refresh_loop(router, metrics))
            auth = " (bearer token required: server.auth_token_file)" \
                if cfg.server.auth_token_file else ""
            print(f"pdserve: metrics on {url}{auth}", flush=True)
        planning = None
        if cfg.pools.planner:
            planning = asyncio.ensure_future(start_planner(router, cfg, metrics=getattr(
                router, "metrics", None)).run())

        def ready(server) -> None:
            print(f"pdserve: serving pdserve.v1.Generation on {server.address} ({mode} "
                  "backend); Ctrl-C drains and stops", flush=True)
            if server.http_url is not None:
                print(f"pdserve: serving the OpenAI-compatible API on {server.http_url}/v1 "
                      f"(model {server.model_name!r})", flush=True)

        try:
            await serve(router, served, on_started=ready)
        except startup_errors() as e:
            await router.shutdown(0.0)
            raise StartupError(str(e)) from e
        finally:
            for task in (refresher, planning):
                if task is not None:
                    task.cancel()

    run_loop(main(), cfg.server.event_loop)
    return 0


def start_planner(router, cfg, metrics=None):
    """The live planner of `pools.planner` (cluster/serve/planner.py) over `router`: it
    sees every arrival from now on."""
    from cluster.config.serve import slo_pairs
    from cluster.serve.planner import Planner, PlannerConfig

    p = cfg.pools
    if p.colocated or cfg.server.api_servers > 1:
        raise StartupError("pools.planner needs the disaggregated pools and one front door "
                           "(server.api_servers 1): it moves workers of this router's pools")
    planner = Planner(router, PlannerConfig(
        window_s=p.planner_window_s, dwell_s=p.planner_dwell_s, margin=p.planner_margin,
        min_requests=p.planner_min_requests, slos_ms=slo_pairs(p.planner_slo)),
        cfg.to_dict(), metrics=metrics)
    router.on_arrival = planner.observe
    return planner


# ---- generate / stats: client side --------------------------------------------------
def _add_conn(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=DEFAULT_ADDR, help=f"server HOST:PORT (default {DEFAULT_ADDR})")
    p.add_argument("--token-file", help="file with the bearer token (server.auth_token_file)")
    p.add_argument("--tls-ca", help="PEM CA/certificate to trust: connect with TLS")
    p.add_argument("--timeout", type=float, default=None, help="RPC deadline in seconds")


def _client(args: argparse.Namespace):
    from cluster.grpc.auth import read_token
    from cluster.grpc.client import PdserveClient

    token = read_token(args.token_file) if args.token_file else None
    return PdserveClient(args.addr, token=token, tls_ca=args.tls_ca, timeout=args.timeout)


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="prompt text ('-': read stdin)")
    p.add_argument("--token-ids", help="comma-separated prompt token ids instead of text")
    p.add_argument("--max-tokens", type=int, help="tokens to generate (server default 16)")
    p.add_argument("--temperature", type=float, help="0 = greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--top-k", type=int, help="-1 = off, else >= 1")
    p.add_argument("--seed", type=int, help="per-request sampling seed")
    p.add_argument("--stop-token-ids", help="comma-separated extra stop token ids")
    p.add_argument("--ignore-eos", action="store_true", default=None, help="do not stop at EOS")
    p.add_argument("--tenant", default="", help="fairness key (default 'default')")
    p.add_argument("--priority", type=int, default=0,
                   help="scheduling priority: lower is served first by the 'priority' "
                   "fairness policy (as vLLM's); other policies ignore it (default 0)")
    p.add_argument("--request-id", default="", help="request id (default: server-assigned)")
    p.add_argument("--show-token-ids", action="store_true", help="print token ids at the end")
    _add_conn(p)


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t] if text else []


def _run_generate(args: argparse.Namespace) -> int:
    import grpc

    if args.token_ids:
        prompt: str | list[int] = _ints(args.token_ids)
    elif args.prompt == "-":
        prompt = sys.stdin.read()
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        print("pdserve generate: error: give a prompt (or --token-ids)", file=sys.stderr)
        return 2
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, seed=args.seed, stop_token_ids=_ints(args.stop_token_ids),
              ignore_eos=args.ignore_eos, tenant=args.tenant, priority=args.priority,
              request_id=args.request_id)
    with _client(args) as client:
        stream = client.generate(prompt, **kw)
        tokens: list[int] = []
        last = None
        try:
            for chunk in stream:
                tokens.extend(chunk.token_ids)
                print(chunk.text, end="", flush=True)
                last = chunk
        except KeyboardInterrupt:
            stream.cancel()
            print("\n[cancelled]", file=sys.stderr)
            return 130
        except grpc.RpcError as e:
            print(f"\npdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print()
    if args.show_token_ids:
        print(f"token_ids: {tokens}")
    if last is not None and last.usage is not None:
        u = last.usage
        print(f"[{last.request_id}] finish={last.finish_reason} prompt={u.prompt_tokens} "
              f"completion={u.completion_tokens} cached={u.cached_prompt_tokens} "
              f"ttft={u.ttft_s * 1e3:.1f}ms queue={u.queue_s * 1e3:.1f}ms "
              f"e2e={u.e2e_s * 1e3:.1f}ms", file=sys.stderr)
    return 0


def _run_stats(args: argparse.Namespace) -> int:
    import grpc

    try:
        with _client(args) as client:
            print(format_stats(client.stats()))
    except grpc.RpcError as e:
        print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


# ---- make-model ---------------------------------------------------------------------
def _add_make_model(p: argparse.ArgumentParser) -> None:
    from engine.model_fetch import CONVERT_DTYPES, REAL_MODELS

    random = ("tiny", "small", "qwen2-0.5b-shape")
    p.add_argument("--preset", default="tiny", choices=(*random, *REAL_MODELS),
                   help="random model sizes " + ", ".join(random) + "; real models: " +
                   "; ".join(f"{m.name} = {m.description}" for m in REAL_MODELS.values()) +
                   " (default tiny)")
    p.add_argument("--arch", default="llama", choices=("llama", "qwen2", "qwen3", "mistral"),
                   help="architecture of a random model (default llama)")
    p.add_argument("--out", help="output directory (default: a real model goes to the cache, "
                   "~/.cache/pdserve/models or $PDSERVE_CACHE_DIR; required for random ones)")
    p.add_argument("--seed", type=int, default=0, help="weight seed of a random model")
    p.add_argument("--dtype", default="float32", choices=CONVERT_DTYPES,
                   help="weight dtype of a real model's conversion (default float32)")


def _run_make_model(args: argparse.Namespace) -> int:
    from engine.model_fetch import REAL_MODELS, ensure_real_model
    from engine.tiny_model import make_model

    if args.preset in REAL_MODELS:
        print(ensure_real_model(args.preset, args.dtype, out=args.out))
        return 0
    if args.out is None:
        fail(f"make-model --preset {args.preset}: give --out DIR")
    print(make_model(args.out, args.preset, args.arch, seed=args.seed))
    return 0


def _add_demo(p: argparse.ArgumentParser) -> None:
    from cluster.demo import add_args

    add_args(p)


def _run_demo(args: argparse.Namespace) -> int:
    from cluster.demo import run

    return run(args)


register("serve", "serve the gRPC API (P/D pools, or --colocated)", _add_serve, _run_serve)
register("generate", "stream one completion from a server", _add_generate, _run_generate)
register("stats", "print a server's worker table", lambda p: _add_conn(p), _run_stats)
register("make-model", "write a deterministic random HF model dir, or fetch and convert a "
         "real one (--preset smollm2)", _add_make_model, _run_make_model)
register("demo", "serve in-process and stream 4 requests", _add_demo, _run_demo)


def build_parser() -> argparse.ArgumentParser:
    _load_plugins()
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving.",
        epilog=keys_epilog() + "\n\nRun `pdserve COMMAND --help` for a command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_args(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except StartupError as e:
        fail(str(e))
    except Exception as e:
        from engine.loader import ModelLoadError
        from engine.model_fetch import ModelFetchError

        if isinstance(e, ModelLoadError | ModelFetchError):  # from any subcommand
            fail(str(e))
        raise


if __name__ == "__main__":
    sys.exit(main())
