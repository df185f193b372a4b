"""Layer-wise sends of the final chunk, off against on (issue 40), on real services.

Each variant is a 1P1D service (Ray actors, real sockets, real KV bytes) on an emulated
accelerator over an emulated link (``transfer.link_gbps``), given long prompts one at a
time (spaced so none waits for another: each request's own pipeline is measured), with
worker traces. Printed per variant:

- TTFT p50/p99: the client's first token (in pdserve it comes from the prefill worker
  through the router, before the KV has moved), and the second token's p50/p99, the
  first one the decode worker produces, once every chunk's KV arrived.
- **final-chunk hidden share** (bench/studies/pacing.py ``final_chunk_overlap``), per
  request, then the mean and the minimum over them: the final chunk's transfer time
  hidden behind its own step, ``|U ∩ S| / |U|``, where ``U`` is the union of the emulated
  wire intervals of the final chunk's frames (the sender's per-frame records: ``kv_send``
  spans whose ``chunk_id`` is its seq_no) and ``S`` the final chunk's step on the prefill
  worker's emulated device (its ``prefill_chunk`` span's ``device_start`` /
  ``device_end``). Beside it the looser ``span`` form: ``[first byte on the wire, last
  byte off it]`` against ``S``, over that interval's length; and the **exposed tail**: the
  final chunk's last byte off the wire after its step's end (ms).

    python tools/layerwise_bench.py --connector tcp --prompt-len 4096:8192 --chunk 1024 \
        --link-gbps 400 --emulate-kv-fraction 0.25 --num-prompts 12

Figures are "emulated <profile>, <shape>: analytic, not measured" (engine/emulate/).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def run_variant(args, layerwise: bool, connector: str) -> dict:
    from bench.studies.pacing import final_chunk_overlap
    from bench.studies.service import Service, ensure_ray
    from bench.workload import WorkloadRequest
    from cluster.config.serve import ServeConfig
    from engine.emulate.model_dir import emulated_model_dir

    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    cfg = ServeConfig.from_dict({
        "model": {"path": str(emulated_model_dir(args.model_shape)), "device": "cpu",
                  "emulate": args.emulate, "model_shape": args.model_shape,
                  "emulate_kv_fraction": args.emulate_kv_fraction, "dtype": "bfloat16",
                  "max_model_len": hi + 64},
        "pools": {"cpus_per_worker": 1.0, "max_restarts": 0},
        "cache": {"kv_cache_memory_gb": args.kv_cache_memory_gb, "enable_prefix_caching": False},
        "scheduler": {"max_prefill_chunk": args.chunk, "max_num_batched_tokens": args.chunk},
        "transfer": {"connector": connector, "link_gbps": args.link_gbps,
                     "layerwise": layerwise, "layerwise_groups": args.groups},
    })
    ensure_ray()
    rng = random.Random(args.seed)
    vocab = 128_000
    work = [WorkloadRequest(f"lw-{i}", i * args.gap_s,
                            [rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))],
                            args.output_len, kind="long") for i in range(args.num_prompts)]
    svc = Service(cfg, trace=True)
    try:
        svc.run_workload(work[:1])  # warm: the first request's links and buffers
        out = svc.run_workload(work)
    finally:
        svc.close()
    ok = [r for r in out.records if r.success and len(r.token_times) >= 2]
    ttft = [(r.token_times[0] - r.send_time) * 1e3 for r in ok]
    second = [(r.token_times[1] - r.send_time) * 1e3 for r in ok]
    ov = final_chunk_overlap(out.events)
    vals = list(ov.values())
    row = {"connector": connector, "layerwise": layerwise, "ok": len(ok),
           "failed": len(out.records) - len(ok),
           "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
           "second_token_p50_ms": _pct(second, 50), "second_token_p99_ms": _pct(second, 99),
           "hidden_mean": statistics.mean(v["busy"] for v in vals) if vals else None,
           "hidden_min": min(v["busy"] for v in vals) if vals else None,
           "hidden_span_mean": statistics.mean(v["span"] for v in vals) if vals else None,
           "tail_p50_ms": _pct([v["tail_s"] * 1e3 for v in vals], 50) if vals else None,
           "final_transfer_p50_ms": _pct([v["transfer_s"] * 1e3 for v in vals], 50)
           if vals else None,
           "final_step_p50_ms": _pct([v["step_s"] * 1e3 for v in vals], 50) if vals else None,
           "requests_traced": len(vals)}
    return row


def run_in_process(args, layerwise: bool, connector: str) -> dict:
    """The prefill engine alone, in this process: its emulated device, a real sender and
    receiver of ``connector`` over the emulated link, the receiver drained (polled and
    released) by a thread of its own; no decode worker, router or Ray. Per request: TTFT
    (its first token's event), KV complete (the receiver's completion), the hidden share."""
    import dataclasses
    import threading
    import time

    from bench.studies.pacing import final_chunk_overlap
    from engine.config import CacheConfig, EmulateConfig, EngineConfig, SchedulerConfig
    from engine.emulate.model_dir import emulated_model_dir
    from engine.loader import load_model_config
    from engine.request import SamplingParams
    from engine.tracing import TraceRecorder
    from kv_transfer import TransferConfig, make_receiver, make_sender
    from prefill_worker.engine import PrefillEngine
    from prefill_worker.scheduler import PrefillSchedulerConfig
    from runtime.messages import EventKind, PrefillTask

    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    f = args.emulate_kv_fraction
    d = emulated_model_dir(args.model_shape)
    model = load_model_config(d)
    cfg = EngineConfig(str(d), model, CacheConfig(16, None, int(args.kv_cache_memory_gb * (1 << 30)),
                                                  False),
                       SchedulerConfig(max_model_len=hi + 64), dtype="bfloat16",
                       emulate=EmulateConfig(args.emulate, args.model_shape, f, args.time_scale))
    # as cluster/launch/worker_specs.py: the link charged the full size
    from engine.config import torch_dtype
    from engine.kv_cache import KVCache

    window = int(max(64 << 20, 2 * args.chunk * KVCache.bytes_per_token(
        model, torch_dtype("bfloat16"))) * f)
    rate = args.link_gbps * 1e9 / 8 * f / args.time_scale  # the link as slow as the device
    tc = TransferConfig(connector=connector, link_rate_bytes_per_s=rate,
                        credit_window_bytes=window,
                        max_frame_bytes=max(64 << 10, min(64 << 20, window)),
                        secret=b"layerwise-bench-secret-0123456789")
    rx, tx = make_receiver(tc), make_sender(tc)
    tracer = TraceRecorder(enabled=True)
    eng = PrefillEngine("prefill-0", cfg, PrefillSchedulerConfig(
        max_num_batched_tokens=args.chunk, max_prefill_chunk=args.chunk), tx,
        (hi + 64) // 16 + 8, tracer, layerwise_groups=args.groups if layerwise else 0)
    completed: dict[str, float] = {}
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            if rx.wait(0.01):
                ev = rx.poll()
                for c in ev.chunks:
                    rx.release(c)
                now = time.monotonic()
                for rid in ev.completed:
                    completed[rid] = now

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    rng = random.Random(args.seed)
    sp = dataclasses.replace(SamplingParams(temperature=0.0, max_tokens=args.output_len),
                             ignore_eos=True)
    ttft, kv_done = [], []
    try:
        for i in range(args.num_prompts + 1):  # the first warms the link
            rid = f"lw-{i}"
            prompt = tuple(rng.randrange(1, model.vocab_size) for _ in range(rng.randint(lo, hi)))
            t0 = time.monotonic()
            eng.add(PrefillTask(rid, prompt, sp, rx.endpoint, ()))
            first = None
            while eng.has_work or rid not in completed:
                assert time.monotonic() - t0 < 60, f"{rid} did not finish"
                for e in eng.step():
                    if e.kind == EventKind.FIRST_TOKEN:
                        first = time.monotonic()
                if not eng.last_step_ran:
                    time.sleep(0.001)
            if i:
                ttft.append((first - t0) * 1e3)
                kv_done.append((completed[rid] - t0) * 1e3)
            time.sleep(args.gap_s / 4)  # the link and device idle between requests
    finally:
        stop.set()
        drainer.join(2)
        tx.close()
        rx.close()
    ov = {k: v for k, v in final_chunk_overlap(tracer.drain()).items() if k != "lw-0"}
    vals = list(ov.values())
    return {"connector": connector, "layerwise": layerwise, "ok": len(ttft),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "kv_complete_p50_ms": _pct(kv_done, 50), "kv_complete_p99_ms": _pct(kv_done, 99),
            "hidden_mean": statistics.mean(v["busy"] for v in vals),
            "hidden_min": min(v["busy"] for v in vals),
            "hidden_span_mean": statistics.mean(v["span"] for v in vals),
            "tail_p50_ms": _pct([v["tail_s"] * 1e3 for v in vals], 50),
            "final_transfer_p50_ms": _pct([v["transfer_s"] * 1e3 for v in vals], 50),
            "final_step_p50_ms": _pct([v["step_s"] * 1e3 for v in vals], 50),
            "requests_traced": len(vals)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--emulate", default="h200", help="emulated accelerator profile (default h200)")
    p.add_argument("--model-shape", default="llama-3-8b", help="its model shape (default llama-3-8b)")
    p.add_argument("--connector", default="tcp", help="comma-separated connectors (default tcp)")
    p.add_argument("--prompt-len", default="4096:8192", help="uniform prompt length LO:HI")
    p.add_argument("--output-len", type=int, default=4, help="output tokens per request")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk (and step budget)")
    p.add_argument("--groups", type=int, default=8, help="transfer.layerwise_groups")
    p.add_argument("--link-gbps", type=float, default=400.0, help="emulated link, Gbit/s")
    p.add_argument("--emulate-kv-fraction", type=float, default=0.25,
                   help="share of each chunk's KV layers sent, the link charged in full")
    p.add_argument("--kv-cache-memory-gb", type=float, default=3.0, help="KV pool per worker")
    p.add_argument("--num-prompts", type=int, default=12, help="requests per variant")
    p.add_argument("--gap-s", type=float, default=1.0, help="seconds between arrivals")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--variants", default="off,on", help="layer-wise off,on (or one of them)")
    p.add_argument("--in-process", action="store_true",
                   help="the prefill engine alone in this process, its receiver drained "
                   "(no decode worker, router or Ray): where this host's service path "
                   "cannot keep up with the emulated device and link")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="with --in-process: every device time and the link's this many "
                   "times slower (EmulateConfig.time_scale): shares as on a host this many "
                   "times faster than this one; times printed as measured (divide by it)")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    print(f"emulated {args.emulate}, {args.model_shape}: analytic, not measured; link "
          f"{args.link_gbps:g} Gbit/s emulated; KV sent: {args.emulate_kv_fraction:g} of each "
          f"chunk's bytes (the link charged in full); prompts {args.prompt_len}, chunk "
          f"{args.chunk}, {args.groups} layer groups"
          f"{'; in process: prefill engine alone' if args.in_process else '; 1P1D service'}"
          f"{f'; time x{args.time_scale:g}' if args.time_scale != 1 else ''}",
          flush=True)
    rows = []
    for connector in args.connector.split(","):
        for v in args.variants.split(","):
            row = (run_in_process if args.in_process else run_variant)(args, v == "on",
                                                                        connector)
            rows.append(row)
            print(json.dumps({k: round(x, 3) if isinstance(x, float) else x
                              for k, x in row.items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
