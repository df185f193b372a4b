"""Decode paged-attention bandwidth on CUDA: Triton kernel vs torch (gather + SDPA).

For every (batch, context) pair, each of `batch` sequences holds `context` tokens in a
paged bf16 cache behind a shuffled block table. One decode step reads
`2 * batch * context * kv_heads * head_dim * elem` K/V bytes; achieved bytes/s is that over
the step's time, reported as a fraction of the read-only bandwidth measured in the same
run (a reduction over 4 GiB: what a kernel that only reads can reach), of the
device-to-device copy bandwidth (read + write bytes of a 4 GiB clone), and as a ratio to
the torch baseline, which gathers the blocks into a dense tensor and runs
`F.scaled_dot_product_attention` (group heads as query rows; no mask: equal lengths).

Times are CUDA-event timings of CUDA-graph replays (many calls per replay, median of
replays), after warm-up; calls rotate over enough input sets (caches, tables, queries)
that together they are 4x the L2 (50-60 MiB on H100/H200), so even the smallest case
reads from HBM. Goal (H200): >= 70% of read bandwidth at contexts >= 4k and >= 2x the
baseline.

    python tools/attention_bw.py --quick --json bench/results/attn.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python tools/attention_bw.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from tools.attention_bw_report import print_header, print_row, print_summary, summarize
from tools.cuda_timing import copy_bandwidth_gbps, read_bandwidth_gbps, time_per_call_ms

DEVICE = "cuda"  # module-level so a CPU dry run of the plumbing can swap it (tests/scratch)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL_BATCHES = [1, 4, 16, 64, 256]
FULL_CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
QUICK_BATCHES = [1, 16, 128]
QUICK_CONTEXTS = [512, 4096, 32768]
MAX_ROTATING_SETS = 512  # input sets one timed loop cycles through (L2 defeat)
# (batch, context) points for --sweep and the kernel variants tried there
SWEEP_POINTS = [(1, 32768), (16, 8192), (64, 4096), (256, 4096)]
SWEEP_VARIANTS: list[dict[str, int]] = [
    {},  # the shipped heuristics
    # split-K sizing: programs per SM the grid aims for, and the shortest partition
    {"target_programs_per_sm": 2}, {"target_programs_per_sm": 3},
    {"target_programs_per_sm": 6}, {"target_programs_per_sm": 8},
    {"target_programs_per_sm": 16, "min_partition": 128}, {"min_partition": 1024},
    # tiles and pipelining
    {"block_n": 32}, {"block_n": 128, "num_stages": 2}, {"num_warps": 8},
    {"num_stages": 2}, {"num_stages": 4},
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Decode paged-attention bandwidth: Triton vs torch gather+SDPA vs copy bw.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--batch-sizes", type=_ints, default=FULL_BATCHES,
                   help="comma-separated decode batch sizes (sequences per step)")
    p.add_argument("--contexts", type=_ints, default=FULL_CONTEXTS,
                   help="comma-separated context lengths in tokens (same for every sequence)")
    p.add_argument("--quick", action="store_true",
                   help=f"only batches {QUICK_BATCHES} x contexts {QUICK_CONTEXTS}")
    p.add_argument("--num-heads", type=int, default=128, help="query heads")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (GQA group = ratio)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache page")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument("--sweep", action="store_true",
                   help=f"also time kernel variants (tile, warps, stages, split heuristic) at "
                        f"{SWEEP_POINTS} to guide the launch heuristics")
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the copy-bandwidth probe")
    p.add_argument("--mem-fraction", type=float, default=0.85,
                   help="skip combos needing more than this fraction of free GPU memory")
    p.add_argument("--graph-ms", type=float, default=25.0,
                   help="target duration of one timed CUDA-graph replay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.contexts = QUICK_BATCHES, QUICK_CONTEXTS
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------------- one combo


def torch_gather_sdpa(q, k_cache, v_cache, table, context, scale):  # type: ignore[no-untyped-def]
    """Baseline: gather the pages into dense [S, KVH, T, D] K/V, then SDPA per KV head."""
    s, h, d = q.shape
    kvh = k_cache.shape[2]
    # [S, blocks, bs, KVH, D] copy -> [S, T, KVH, D] -> first `context` tokens -> [S, KVH, T, D]
    k = k_cache[table].view(s, -1, kvh, d)[:, :context].transpose(1, 2)
    v = v_cache[table].view(s, -1, kvh, d)[:, :context].transpose(1, 2)
    qg = q.view(s, kvh, h // kvh, d)  # the group's heads act as query rows
    return F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(s, h, d)


def build_inputs(args, batch: int, context: int, n_sets: int, gen: torch.Generator):  # type: ignore[no-untyped-def]
    dtype = DTYPES[args.dtype]
    nblk = math.ceil(context / args.block_size)
    total = n_sets * batch * nblk
    shape = (total, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device=DEVICE, dtype=dtype, generator=gen)
    perm = torch.randperm(total, device=DEVICE, generator=gen).to(torch.int32)
    tables = list(perm.view(n_sets, batch, nblk).unbind(0))  # shuffled, disjoint per set
    qs = [torch.randn(batch, args.num_heads, args.head_dim, device=DEVICE, dtype=dtype,
                      generator=gen) for _ in range(n_sets)]
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, tables, qs, lens


def rotating_sets(kv_bytes: int, l2_bytes: int) -> int:
    """Input sets to cycle through so that they hold >= 4x the L2 together."""
    return max(1, min(MAX_ROTATING_SETS, math.ceil(4 * l2_bytes / kv_bytes)))


def run_combo(args, batch: int, context: int, copy_gbps: float, l2_bytes: int,
              variants: list[dict[str, int]] | None = None,
              read_gbps: float | None = None) -> dict[str, Any] | None:
    from engine.attention import triton_decode

    elem = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem
    n_sets = rotating_sets(kv_bytes, l2_bytes)  # defeat L2 reuse
    need = n_sets * kv_bytes * (1.0 if args.no_torch else 2.1) + (256 << 20)
    free, _ = torch.cuda.mem_get_info()
    if need > args.mem_fraction * free:
        print(f"skip batch={batch} context={context}: needs {need / 2**30:.1f} GiB, "
              f"{free / 2**30:.1f} GiB free")
        return None
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    k_cache, v_cache, tables, qs, lens = build_inputs(args, batch, context, n_sets, gen)
    scale = args.head_dim**-0.5
    row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes,
                           "rotating_sets": n_sets, "rotated_bytes": n_sets * kv_bytes}
    splits, partition = triton_decode.plan_splits(
        batch, args.num_kv_heads, tables[0].shape[1] * args.block_size,
        triton_decode.decode_config(DTYPES[args.dtype], args.head_dim, k_cache.device)["block_n"],
        k_cache.device,
    )
    row.update(num_splits=splits, partition=partition)

    def triton_calls(**kw: int) -> list[Callable[[], Any]]:
        return [lambda i=i: triton_decode.paged_decode(qs[i], k_cache, v_cache, tables[i], lens,
                                                        scale, **kw) for i in range(n_sets)]

    for kw in variants or [{}]:
        try:
            ms, how = time_per_call_ms(triton_calls(**kw), args.graph_ms)
        except Exception as exc:  # a sweep variant may not fit (smem)
            print(f"  variant {kw} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        if variants:
            row.setdefault("variants", []).append({"overrides": kw, "ms": ms, "GBps": gbps})
        if not kw:
            row.update(triton_ms=ms, triton_GBps=gbps, fraction_of_copy_bw=gbps / copy_gbps,
                       timing=how)
            if read_gbps:
                row["fraction_of_read_bw"] = gbps / read_gbps
    out_tri = triton_decode.paged_decode(qs[0], k_cache, v_cache, tables[0], lens, scale)
    if not args.no_torch:
        calls = [lambda i=i: torch_gather_sdpa(qs[i], k_cache, v_cache, tables[i], context, scale)
                 for i in range(n_sets)]
        ms, _ = time_per_call_ms(calls, args.graph_ms)
        row.update(torch_ms=ms, torch_GBps=kv_bytes / (ms * 1e-3) / 1e9)
        row["ratio_vs_torch"] = ms / row["triton_ms"]
        out_ref = torch_gather_sdpa(qs[0], k_cache, v_cache, tables[0], context, scale)
        row["max_abs_diff_vs_torch"] = (out_tri.float() - out_ref.float()).abs().max().item()
    return row  # caches are freed on return; the caller empties the allocator cache


def main(argv: list[str] | None = None) -> int:
    return 0 if run(argv) is not None else 2


def run(argv: list[str] | None = None) -> dict[str, Any] | None:
    """The benchmark; returns its JSON document (None without CUDA or Triton)."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_bw: no CUDA device found. This benchmark times the Triton decode "
              "kernel against HBM bandwidth and needs an NVIDIA GPU; on CPU the kernels run "
              "only in Triton's interpreter (see tests/unit/test_triton_attention.py).",
              file=sys.stderr)
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        print("attention_bw: triton is not installed (pip install 'pdserve[triton]')",
              file=sys.stderr)
        return None
    props = torch.cuda.get_device_properties(0)
    l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))
    copy_gbps = copy_bandwidth_gbps(args.copy_gib)
    torch.cuda.empty_cache()
    read_gbps = read_bandwidth_gbps(args.copy_gib)
    torch.cuda.empty_cache()
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {l2_bytes >> 20} MiB; "
          f"copy bandwidth (read+write): {copy_gbps:.0f} GB/s; read-only: {read_gbps:.0f} GB/s")
    print(f"shape: {args.num_heads} q heads / {args.num_kv_heads} kv heads, head_dim "
          f"{args.head_dim}, block {args.block_size}, {args.dtype}")
    print_header()
    rows = []
    for batch in args.batch_sizes:
        for context in args.contexts:
            r = run_combo(args, batch, context, copy_gbps, l2_bytes, read_gbps=read_gbps)
            torch.cuda.empty_cache()
            if r is not None and "triton_ms" in r:
                rows.append(r)
                print_row(r)
    sweep = []
    if args.sweep:
        print("\nsweep (GB/s per variant; {} = current heuristics):")
        for batch, context in SWEEP_POINTS:
            r = run_combo(args, batch, context, copy_gbps, l2_bytes, variants=SWEEP_VARIANTS,
                          read_gbps=read_gbps)
            torch.cuda.empty_cache()
            if r is None:
                continue
            sweep.append(r)
            best = max(r.get("variants", []), key=lambda v: v["GBps"], default=None)
            for v in r.get("variants", []):
                print(f"  batch={batch:<4} ctx={context:<6} {json.dumps(v['overrides']):<45} "
                      f"{v['GBps']:8.0f} GB/s ({v['GBps'] / copy_gbps:.2f} of copy)"
                      f"{'  <- best' if v is best else ''}")
    summary = summarize(rows)
    print_summary(summary)
    doc = {"device": props.name, "sm_count": props.multi_processor_count,
           "l2_bytes": l2_bytes, "copy_bw_GBps": copy_gbps, "read_bw_GBps": read_gbps,
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "config": {k: v for k, v in vars(args).items() if k != "json"},
           "results": rows, "summary": summary, "sweep": sweep}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2))
        print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    sys.exit(main())
