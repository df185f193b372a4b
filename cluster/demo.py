"""`pdserve demo`: serve in-process on an ephemeral port, stream 4 concurrent requests
(one with a long, multi-chunk prompt) through the gRPC client, print a stats table, stop.

The backend is the P/D service when `cluster.launcher` is importable, else the colocated
engine; `--colocated` / `--disaggregated` choose explicitly. Every serve flag applies.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from cluster.config import ServeConfig

PROMPTS = {
    "short-0": "Beautiful is better than ugly.",
    "short-1": "The quick brown fox",
    "short-2": "Return a new list containing",
}
LONG_CHARS = 2400  # ~700 tokens of the tiny tokenizer: several prefill chunks
MAX_TOKENS = 24


def add_args(p: argparse.ArgumentParser) -> None:
    ServeConfig.add_cli_flags(p)  # includes --colocated / --no-colocated
    p.add_argument("--disaggregated", dest="pools.colocated", action="store_const",
                   const=False, default=argparse.SUPPRESS,
                   help="use the prefill/decode pools (default when cluster.launcher exists)")
    p.add_argument("--demo-max-tokens", type=int, default=MAX_TOKENS,
                   help=f"tokens per demo request (default {MAX_TOKENS})")


def long_prompt() -> str:
    corpus = (Path(__file__).resolve().parents[1] / "engine" / "data" / "corpus.txt").read_text()
    return corpus[1000:1000 + LONG_CHARS]


def run(args: argparse.Namespace) -> int:
    from cluster.cli import config_or_exit, launcher_available, setup_logging

    if "pools.colocated" not in vars(args):
        setattr(args, "pools.colocated", not launcher_available())
    if "server.port" not in vars(args):
        setattr(args, "server.port", 0)  # ephemeral: never collide with a real server
    if "server.log_level" not in vars(args):
        setattr(args, "server.log_level", "warning")
    cfg = config_or_exit(args)
    setup_logging(cfg.server.log_level)
    try:
        return asyncio.run(_demo(cfg, args.demo_max_tokens))
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return 130


async def _one(client, name: str, prompt: str, max_tokens: int, width: int,
               streaming: asyncio.Event):
    import grpc

    try:
        async for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                           request_id=f"demo-{name}"):
            streaming.set()
            if chunk.text:
                print(f"[{name:>{width}}] {chunk.text!r}", flush=True)
            if chunk.finished:
                return chunk
    except grpc.RpcError as e:
        print(f"[{name:>{width}}] error {e.code().name}: {e.details()}", flush=True)
    return None


async def _demo(cfg: ServeConfig, max_tokens: int) -> int:
    from cluster.cli import build_router, format_stats
    from cluster.client import AsyncPdserveClient
    from cluster.server import GenerationServer

    mode = "colocated" if cfg.pools.colocated else "disaggregated (prefill/decode pools)"
    print(f"demo: starting the {mode} backend ...", flush=True)
    router = await build_router(cfg)
    server = GenerationServer(router, cfg)
    try:
        addr = await server.start()
    except BaseException:
        await router.shutdown(0.0)
        raise
    try:
        print(f"demo: serving on {addr}", flush=True)
        prompts = dict(PROMPTS, long=long_prompt())
        width = max(map(len, prompts))
        async with AsyncPdserveClient(addr) as client:
            streaming = asyncio.Event()
            tasks = [asyncio.create_task(_one(client, n, p, max_tokens, width, streaming))
                     for n, p in prompts.items()]
            await asyncio.wait([asyncio.ensure_future(streaming.wait()), *tasks],
                               return_when=asyncio.FIRST_COMPLETED)
            print("demo: stats while running:\n" + format_stats(await client.stats()),
                  flush=True)
            finals = await asyncio.gather(*tasks)
            print("\ndemo: results")
            for name, last in zip(prompts, finals, strict=True):
                if last is None or last.usage is None:
                    print(f"  {name:>{width}}: failed")
                    continue
                u = last.usage
                print(f"  {name:>{width}}: prompt={u.prompt_tokens:4d} tok  "
                      f"completion={u.completion_tokens:3d} tok  ttft={u.ttft_s * 1e3:7.1f} ms  "
                      f"e2e={u.e2e_s * 1e3:7.1f} ms  finish={last.finish_reason}")
            print("\ndemo: stats after:\n" + format_stats(await client.stats()), flush=True)
        return 0 if all(f is not None for f in finals) else 1
    finally:
        await server.stop(drain_timeout_s=5.0)
        print("demo: stopped cleanly", flush=True)
