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
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    print(f"emulated {args.emulate}, {args.model_shape}: analytic, not measured; link "
          f"{args.link_gbps:g} Gbit/s emulated; KV sent: {args.emulate_kv_fraction:g} of each "
          f"chunk's bytes (the link charged in full); prompts {args.prompt_len}, chunk "
          f"{args.chunk}, {args.groups} layer groups", flush=True)
    rows = []
    for connector in args.connector.split(","):
        for v in args.variants.split(","):
            row = run_variant(args, v == "on", connector)
            rows.append(row)
            print(json.dumps({k: round(x, 3) if isinstance(x, float) else x
                              for k, x in row.items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
