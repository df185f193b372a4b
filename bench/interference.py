"""Interference benchmark: do long prompts hurt running decodes?

Layouts, side by side in one run, same model and workload, one CPU core per worker:
  disagg     1 prefill + 1 decode worker (chunked prefill, KV streamed over tcp)
  colocated  2 colocated engines without chunked prefill, requests split between them
             (the layout of vLLM's own disaggregation benchmark)
Workload: 8 streaming chat requests (prompt 128, output 256), first alone, then again
while long prompts (2048 tokens) arrive every few seconds. Prints chat ITL p50/p99 and
long-prompt TTFT per layout, then `ratio <layout>: X` = chat ITL p99 with long prompts
over chat ITL p99 without them. Goal: disagg <= 1.25 while colocated grows far beyond.

  python -m bench.interference            # qwen2-0.5b-shape (minutes on 2 cores)
  python -m bench.interference --quick    # the small preset, shorter requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

import numpy as np

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
    p.add_argument("--long", type=int, default=3, help="number of long prompts")
    p.add_argument("--long-prompt", type=int, default=2048, help="long prompt tokens")
    p.add_argument("--long-every", type=float, default=4.0,
                   help="seconds between long-prompt arrivals")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (disagg)")
    p.add_argument("--quick", action="store_true",
                   help="small preset, 64-token outputs, 1024-token long prompts")
    p.add_argument("--json", type=Path, help="write all figures as JSON here")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.arch = "small", "qwen2"
        args.chat_output, args.long_prompt, args.long_every = 64, 1024, 1.0
    return args


def workload(args, with_long: bool, tag: str) -> list[TimedRequest]:
    rng = random.Random(args.seed)
    reqs = [TimedRequest(f"{tag}-chat-{i}", 0.05 * i,
                         tuple(rng.randrange(1, 2000) for _ in range(args.chat_prompt)),
                         args.chat_output, kind="chat") for i in range(args.chat)]
    if with_long:
        reqs += [TimedRequest(f"{tag}-long-{i}", 1.0 + args.long_every * i,
                              tuple(rng.randrange(1, 2000) for _ in range(args.long_prompt)),
                              8, kind="long") for i in range(args.long)]
    return reqs


def summarize(records) -> dict:
    chat = [r for r in records if r.kind == "chat" and r.success]
    itl = [g for r in chat for g in r.itls] or [float("nan")]
    longs = [r.ttft for r in records if r.kind == "long" and r.success and r.ttft]
    return {"itl_p50_ms": float(np.percentile(itl, 50) * 1e3),
            "itl_p99_ms": float(np.percentile(itl, 99) * 1e3),
            "long_ttft_mean_s": float(np.mean(longs)) if longs else None,
            "failed": sum(not r.success for r in records)}


def run_layout(name: str, router, args) -> dict:
    async def go():
        base = await run_workload(router, workload(args, False, f"{name}-base"))
        mixed = await run_workload(router, workload(args, True, f"{name}-mixed"))
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
    print(f"model {args.preset} ({args.arch}); chat {args.chat} x (prompt {args.chat_prompt}, "
          f"output {args.chat_output}); long prompts {args.long} x {args.long_prompt}")
    for name, r in results.items():
        for phase in ("without_long", "with_long"):
            s = r[phase]
            print(f"{name:10s} {phase:13s} chat ITL p50 {s['itl_p50_ms']:8.1f} ms  "
                  f"p99 {s['itl_p99_ms']:8.1f} ms  long TTFT {s['long_ttft_mean_s'] or 0:6.2f} s"
                  f"  failed {s['failed']}")
    for name, r in results.items():
        print(f"ratio {name}: {r['ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
