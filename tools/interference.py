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

The experiment (workload, phases, summary) is `pdserve study interference`'s
(bench/studies/interference.py); this command runs it on routers of its own, without
the study's emulated link, and prints its own lines.

  python -m tools.interference            # qwen2-0.5b-shape (minutes on 2 cores)
  python -m tools.interference --quick    # the small preset, shorter requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from bench.records import RequestRecord
from bench.router_driver import run_workload, timed_requests
from bench.studies.interference import (
    LAYOUTS,
    InterferenceSpec,
    layout_config,
    run_phase,
    summarize,
)
from bench.studies.service import OnDone, build_router
from bench.workload import WorkloadRequest
from cluster.config.serve import ServeConfig
from engine.tiny_model import ensure_model

SPEC_FIELDS = ("chat", "chat_prompt", "chat_output", "long", "long_prompt", "long_every", "seed")


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


def spec_of(args: argparse.Namespace) -> InterferenceSpec:
    return InterferenceSpec(**{k: getattr(args, k) for k in SPEC_FIELDS})


def run_layout(name: str, router, spec: InterferenceSpec) -> dict:
    """Both phases on ``router`` (in-process), then its shutdown; the two summaries."""
    async def send(reqs: Sequence[WorkloadRequest],
                   on_done: OnDone | None = None) -> list[RequestRecord]:
        return await run_workload(router, timed_requests(reqs), on_done=on_done)

    async def phase(with_long: bool, label: str):
        bar = tqdm(total=spec.chat, desc=f"{name} {label} (chat requests)", unit="req",
                   leave=False, file=sys.stderr)
        try:
            return await run_phase(send, spec, f"{name}-{label}", with_long,
                                   lambda _: bar.update(1))
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
    import ray

    args = parse_args(argv)
    spec = spec_of(args)
    model = str(ensure_model(args.preset, args.arch))
    base = ServeConfig.from_dict({
        "model": {"path": model, "device": "cpu", "max_model_len": 4096},
        "pools": {"cpus_per_worker": 1.0},
        "scheduler": {"max_prefill_chunk": args.chunk,
                      "max_num_batched_tokens": max(args.chunk, 256)},
        "cache": {"kv_cache_memory_gb": 2.0}, "transfer": {"connector": "tcp"}})
    results = {}
    for name in ("disagg", "colocated"):
        cfg = layout_config(base, LAYOUTS[name], spec.long_prompt)
        results[name] = run_layout(name, build_router(cfg, LAYOUTS[name]), spec)
        ray.shutdown()
    longs = (f"{spec.long} x" if spec.long else
             f"one every {spec.long_every:g} s until the chats end, each")
    print(f"model {args.preset} ({args.arch}); chat {spec.chat} x (prompt {spec.chat_prompt}, "
          f"output {spec.chat_output}); long prompts {longs} {spec.long_prompt} tokens")
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
