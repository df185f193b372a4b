"""The batch-invariant row-block GEMM (`pdserve_cpu::gemv`, engine/models/cpu_step.cpp)
against oneDNN's packed GEMMs (engine/models/linear.py), side by side in one process.

Every projection weight of one decode step of a model (each layer's qkv, o, gate_up and
down, and the lm_head) is multiplied by M rows on both kernels, interleaved, `--repeat`
times; the medians of CPU time (or wall time with `--wall`) are printed with their ratio,
one line per row count, and the rows' bit-equality across batch sizes on both kernels:

    python -m tools.gemm_rows --model-dir smollm2 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _shapes(cfg) -> list[tuple[int, int]]:
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    layer = [(qkv, hid), (hid, cfg.num_heads * cfg.head_dim), (2 * inter, hid), (hid, inter)]
    return layer * cfg.num_layers + [(cfg.vocab_size, hid)]


def invariant_rows(torch, weights, fn, rows: int = 8) -> bool:
    """Does every row get the same bits at 1 row as at 2..`rows` rows, on every weight?"""
    g = torch.Generator().manual_seed(1)
    for (n, k), w in weights:
        x = torch.randn(rows, k, generator=g)
        alone = [fn(x[r:r + 1], w, n)[0] for r in range(rows)]
        for m in range(2, rows + 1):
            y = fn(x[:m], w, n)
            if not all(torch.equal(y[r], alone[r]) for r in range(m)):
                return False
    return True


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m tools.gemm_rows", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--model-dir", default="smollm2", help="model directory, smollm2, or a preset")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="row counts, comma-separated")
    p.add_argument("--repeat", type=int, default=5, help="interleaved timings per row count")
    p.add_argument("--wall", action="store_true", help="wall-clock instead of CPU time")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch starts its pools
    import torch

    from bench.roofline import resolve_model
    from engine.attention import cpu_build, get_backend
    from engine.loader import load_model_config
    from engine.models.linear import pack, packed_mm

    torch.set_num_threads(args.threads)
    if get_backend("cpu", "cpu").name != "cpu":
        sys.exit(f"the pdserve_cpu library is unavailable: {cpu_build.load()}")
    ops, clock = torch.ops.pdserve_cpu, time.perf_counter if args.wall else time.process_time
    cfg = load_model_config(resolve_model(args.model_dir))
    g = torch.Generator().manual_seed(0)
    shapes = _shapes(cfg)
    ws = [torch.randn(n, k, generator=g) * 0.05 for n, k in shapes]
    rows = [((n, k), ops.pack_rows(w)) for (n, k), w in zip(shapes, ws, strict=True)]
    onednn = [((n, k), pack(w)) for (n, k), w in zip(shapes, ws, strict=True)]
    del ws
    gemm = lambda x, w, n: ops.gemv(x, w, None, n)  # noqa: E731
    dnn = lambda x, w, n: packed_mm(x, w, None)  # noqa: E731
    nbytes = sum(4 * n * k for n, k in shapes)
    print(f"{len(shapes)} weights of {args.model_dir} ({nbytes / 1e9:.2f} GB), {args.threads} "
          f"thread(s), {'wall' if args.wall else 'CPU'} time, median of {args.repeat}")
    out = []
    for m in [int(r) for r in args.rows.split(",") if r.strip()]:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in shapes}}
        times: dict[str, list[float]] = {"rowblock": [], "onednn": []}
        for _ in range(args.repeat):
            for name, fn, weights in (("rowblock", gemm, rows), ("onednn", dnn, onednn)):
                t = clock()
                for (n, k), w in weights:
                    fn(xs[k], w, n)
                times[name].append(clock() - t)
        a, b = statistics.median(times["rowblock"]), statistics.median(times["onednn"])
        print(f"rows {m:4d}: row-block {1e3 * a:8.1f} ms  oneDNN {1e3 * b:8.1f} ms  "
              f"ratio row-block/oneDNN {a / b:.2f}", flush=True)
        out.append({"rows": m, "rowblock_s": a, "onednn_s": b, "ratio": a / b})
    raw = lambda x, w, n: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    print("a row's bits at 1 row == at 2..8 rows: row-block "
          f"{invariant_rows(torch, rows, gemm)}, oneDNN {invariant_rows(torch, onednn, raw)}, "
          f"oneDNN with 1..3 rows padded to 4 (linear.packed_mm) "
          f"{invariant_rows(torch, onednn, dnn)}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
