"""Interference benchmark: do long prompts hurt running decodes?

Layouts, side by side in one run, same model and workload, one CPU core per worker:
  disagg     1 prefill + 1 decode worker (chunked prefill, KV streamed over tcp)
  colocated  2 colocated engines without chunked prefill, requests split between them
             (the layout of vLLM's own disaggregation benchmark)
Workload: 8 streaming chat requests (prompt 128, output 256), first alone, then again
while long prompts (2048 tokens) arrive every few seconds (6 of them; `--long 0` keeps them
coming until the chats end, and cancels those still running then: they only interfere). Prints chat
ITL p50/p99/max and long-prompt TTFT per layout, then `ratio <layout>: X` = chat ITL p99
with long prompts over chat ITL p99 without them. Goal: disagg <= 1.25 while colocated
grows far beyond.

  python -m bench.interference            # qwen2-0.5b-shape (minutes on 2 cores)
  python -m bench.interference --quick    # the small preset, shorter requests
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.router_driver import TimedRequest, run_workload
from cluster.config import ServeConfig
from cluster.launcher import build_colocated_pool_router, build_disaggregated_router
from engine.tiny_model import ensure_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2-0.5b-shape",
                   help="embedded model preset (tiny, small, qwen2-0.5b-shape)")
    p.add_argument("--arch", default="qwen2", help="model architecture of the preset")
    p.add_argument("--chat", type=int, default=8, help="number of streaming chat requests")
    p.add_argument("--chat-prompt", type=int, default=128, help="chat prompt tokens")
    p.add_argument("--chat-output", type=int, default=256, help="chat output tokens")
    p.add_argument("--long", type=int, default=6,
                   help="number of long prompts, one every --long-every seconds (default 6); "
                   "0: keep sending them until the chat requests end (what --quick does; "
                   "on the 0.5B model on 2 cores that takes hours colocated)")
    p.add_argument("--long-prompt", type=int, default=2048, help="long prompt tokens")
    p.add_argument("--long-every", type=float, default=4.0,
                   help="seconds between long-prompt arrivals")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (disagg)")
    p.add_argument("--quick", action="store_true",
                   help="small preset, 64-token outputs, 1024-token long prompts every 0.25 s")
    p.add_argument("--json", type=Path, help="write all figures as JSON here")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    args = p.parse_args(argv)
    if args.long < 0:
        p.error("--long must be >= 0")
    if args.quick:
        args.preset, args.arch = "small", "qwen2"
        args.chat_output, args.long_prompt, args.long_every = 64, 1024, 0.25
        args.long = 0
    return args


def chat_workload(args, tag: str) -> list[TimedRequest]:
    rng = random.Random(args.seed)
    return [TimedRequest(f"{tag}-chat-{i}", 0.05 * i,
                         tuple(rng.randrange(1, 2000) for _ in range(args.chat_prompt)),
                         args.chat_output, kind="chat") for i in range(args.chat)]


def long_request(args, tag: str, i: int) -> TimedRequest:
    rng = random.Random(args.seed * 1000 + i + 1)
    return TimedRequest(f"{tag}-long-{i}", 0.2 + args.long_every * i,
                        tuple(rng.randrange(1, 2000) for _ in range(args.long_prompt)),
                        8, kind="long")


async def run_phase(router, args, tag: str, with_long: bool, bar) -> list:
    """The chats, plus (with_long) long prompts arriving until the chats end."""
    t0 = time.monotonic()
    done = lambda _: bar.update(1)  # noqa: E731
    chats = asyncio.ensure_future(run_workload(router, chat_workload(args, tag), on_done=done))
    longs: list[asyncio.Task] = []

    async def feed() -> None:
        i = 0
        while not args.long or i < args.long:
            req = long_request(args, tag, i)
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
            longs.append(asyncio.ensure_future(run_workload(router, [req])))
            i += 1

    feeder = asyncio.ensure_future(feed()) if with_long else None
    records = list(await chats)
    if feeder is not None:
        feeder.cancel()
        if args.long:  # a fixed number: they all finish
            await asyncio.gather(*longs)
        for t in longs:
            if not t.done():
                t.cancel()  # the client hangs up: the router aborts it on both pools
        for t in longs:
            with contextlib.suppress(asyncio.CancelledError):
                records += await t
    return records


def summarize(records) -> dict:
    chat = [r for r in records if r.kind == "chat" and r.success]
    itl = [g for r in chat for g in r.itls] or [float("nan")]
    longs = [r.ttft for r in records if r.kind == "long" and r.success and r.ttft]
    return {"itl_p50_ms": float(np.percentile(itl, 50) * 1e3),
            "itl_p99_ms": float(np.percentile(itl, 99) * 1e3),
            "itl_max_ms": float(np.max(itl) * 1e3),
            "long_ttft_mean_s": float(np.mean(longs)) if longs else None,
            "long_completed": len(longs),
            "failed": sum(not r.success for r in records if r.kind == "chat")}


def run_layout(name: str, router, args) -> dict:
    async def phase(with_long: bool, label: str):
        bar = tqdm(total=args.chat, desc=f"{name} {label} (chat requests)", unit="req",
                   leave=False, file=sys.stderr)
        try:
            return await run_phase(router, args, f"{name}-{label}", with_long, bar)
        finally:
            bar.close()

    async def go():
        base = await phase(False, "base")
        mixed = await phase(True, "mixed")
        await router.shutdown(5)
        return base, mixed

    base, mixed = asyncio.run(go())
    out = {"without_long": summarize(base), "with_long": summarize(mixed)}
    out["ratio"] = out["with_long"]["itl_p99_ms"] / out["without_long"]["itl_p99_ms"]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = str(ensure_model(args.preset, args.arch))
    base = {"model": {"path": model, "device": "cpu", "max_model_len": 4096},
            "pools": {"cpus_per_worker": 1.0},
            "scheduler": {"max_prefill_chunk": args.chunk,
                          "max_num_batched_tokens": max(args.chunk, 256)},
            "cache": {"kv_cache_memory_gb": 2.0}}
    results = {}
    cfg = ServeConfig.from_dict({**base, "transfer": {"connector": "tcp"}})
    results["disagg"] = run_layout("disagg", build_disaggregated_router(cfg), args)
    import ray

    ray.shutdown()
    colo = ServeConfig.from_dict({**base, "scheduler": {
        "max_num_batched_tokens": max(args.long_prompt, 256), "max_prefill_chunk": args.chunk}})
    results["colocated"] = run_layout(
        "colocated", build_colocated_pool_router(colo, 2, enable_chunked_prefill=False), args)
    ray.shutdown()
    longs = (f"{args.long} x" if args.long else
             f"one every {args.long_every:g} s until the chats end, each")
    print(f"model {args.preset} ({args.arch}); chat {args.chat} x (prompt {args.chat_prompt}, "
          f"output {args.chat_output}); long prompts {longs} {args.long_prompt} tokens")
    for name, r in results.items():
        for phase in ("without_long", "with_long"):
            s = r[phase]
            ttft = (f"long TTFT {s['long_ttft_mean_s'] or 0:6.2f} s "
                    f"({s['long_completed']} done)" if phase == "with_long" else "")
            print(f"{name:10s} {phase:13s} chat ITL p50 {s['itl_p50_ms']:8.1f} ms  "
                  f"p99 {s['itl_p99_ms']:8.1f} ms  max {s['itl_max_ms']:8.1f} ms  {ttft}"
                  f"  chat failed {s['failed']}")
    for name, r in results.items():
        print(f"ratio {name}: {r['ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
