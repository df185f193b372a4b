"""Compiled (CUDA graphs) vs eager decode step on a GPU, batch 1..256, against HBM.

    python -m tools.gpu_decode_step --out decode_step.json [--model-dir DIR|preset]
        [--dtype bfloat16] [--batches 1,2,4,...,256] [--context 512] [--steps 20]

For each batch size B, B sequences of `--context` tokens each take decode steps through
`ModelRunner.execute` and a greedy pick (one host sync per step, as serving does), on an
engine built with `compile="none"` and one with `compile="decode"` (one CUDA graph per
batch bucket, recorded at start-up). Per step it reports the median time, output tok/s,
and the fraction of the HBM roof: a decode step must read every weight and the KV of
every context token once, so it cannot beat `(weight bytes + KV bytes) / bandwidth`,
with bandwidth measured in the same run by a device-to-device copy (read + write bytes;
the spec sheet's figure is printed beside it where the GPU is known). Both engines'
greedy tokens are compared on the first step.

Without CUDA it says so, writes `{"skipped": ...}` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HBM_SPEC = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, vendor sheets
NO_CUDA = "no CUDA device: the compiled-vs-eager decode step needs a GPU"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_decode_step",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model-dir", default="qwen2-0.5b-shape",
                   help="model directory, smollm2, or a tiny_model preset")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--context", type=int, default=512, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="timed steps per batch and engine")
    return p.parse_args(argv)


def _chunks(batch: int, context: int, block_size: int, first_block: int):
    from engine.model_runner import SeqChunk

    nb = -(-(context + 1) // block_size)
    return [SeqChunk(f"s{i}", (7 + i % 50,), context,
                     tuple(range(first_block + i * nb, first_block + (i + 1) * nb)), True)
            for i in range(batch)]


def time_engine(llm, batches: list[int], context: int, steps: int) -> dict[int, dict]:
    import torch

    runner, out = llm.runner, {}
    for b in batches:
        chunks = _chunks(b, context, runner.block_size, 1)

        def step(chunks=chunks) -> list[int]:
            _, logits = runner.execute(chunks)
            return logits.argmax(dim=-1).tolist()  # the step's one host sync

        first = step()
        step()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize(runner.device)
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        out[b] = {"step_s": statistics.median(times), "first_tokens": first}
    return out


def run(args: argparse.Namespace) -> dict:
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_decode_step: {NO_CUDA}", file=sys.stderr)
        return {"skipped": NO_CUDA}
    from bench.roofline import resolve_model, weight_bytes
    from engine import LLM
    from engine.kv_cache import KVCache
    from tools.cuda_timing import copy_bandwidth_gbps

    batches = [int(b) for b in args.batches.split(",")]
    model_dir = resolve_model(args.model_dir)
    bs = 16
    blocks = max(batches) * -(-(args.context + 1) // bs) + 2
    doc: dict = {"model_dir": str(model_dir), "dtype": args.dtype, "context": args.context,
                 "gpu": torch.cuda.get_device_name(0), "batches": batches, "engines": {}}
    bw = copy_bandwidth_gbps(2.0) * 1e9  # read + write bytes/s
    spec = next((v for k, v in HBM_SPEC.items() if k in doc["gpu"]), None)
    doc.update(copy_bytes_per_s=bw, hbm_spec_bytes_per_s=spec)
    results = {}
    for mode in ("none", "decode"):
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), device="cuda", dtype=args.dtype, block_size=bs,
                  num_blocks=blocks, max_num_seqs=max(batches),
                  max_model_len=args.context + 2, compile=mode)
        startup = time.perf_counter() - t0
        rep = llm.runner.compiled.report
        doc["engines"][mode] = {"startup_s": startup, "compile": rep.line(),
                                "mode_in_force": rep.mode}
        wbytes = weight_bytes(llm.runner.model)
        kv_tok = KVCache.bytes_per_token(llm.config.model, llm.runner.dtype)
        results[mode] = time_engine(llm, batches, args.context, args.steps)
        del llm
        torch.cuda.empty_cache()
    rows = []
    for b in batches:
        need = wbytes + b * (args.context + 1) * kv_tok
        row = {"batch": b, "bytes_per_step": need}
        for mode, name in (("none", "eager"), ("decode", "compiled")):
            s = results[mode][b]["step_s"]
            row[f"{name}_step_ms"] = 1e3 * s
            row[f"{name}_tok_s"] = b / s
            row[f"{name}_fraction_of_copy_bw"] = need / s / bw
            if spec:
                row[f"{name}_fraction_of_hbm_spec"] = need / s / spec
        row["speedup"] = row["eager_step_ms"] / row["compiled_step_ms"]
        a, c = results["none"][b]["first_tokens"], results["decode"][b]["first_tokens"]
        row["greedy_agree"] = f"{sum(x == y for x, y in zip(a, c, strict=True))}/{b}"
        rows.append(row)
        print(f"B={b:4d}  eager {row['eager_step_ms']:7.3f} ms ({row['eager_tok_s']:9.0f} tok/s)"
              f"  compiled {row['compiled_step_ms']:7.3f} ms ({row['compiled_tok_s']:9.0f} "
              f"tok/s)  x{row['speedup']:.2f}  compiled at "
              f"{100 * row['compiled_fraction_of_copy_bw']:.0f}% of copy bandwidth  "
              f"greedy agree {row['greedy_agree']}", flush=True)
    doc.update(weight_bytes=wbytes, kv_bytes_per_token=kv_tok, results=rows)
    return doc


def gpu_check_step(ctx) -> dict:
    """The `compiled_decode` step of bench/gpu_check (ctx: its model, device and dtype)."""
    quick = ctx.quick
    args = argparse.Namespace(model_dir=ctx.model_dir, dtype=ctx.dtype,
                              batches="1,8,64,256" if quick else ",".join(map(str, BATCHES)),
                              context=256 if quick else 512, steps=10 if quick else 20)
    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"gpu_decode_step: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

