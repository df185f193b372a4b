"""Tensor parallelism on GPUs: greedy exactness and decode tok/s of `LLM(...,
tensor_parallel_size=N)` (NCCL, one GPU per rank) beside the TP = 1 engine, as JSON.

    python -m tools.tp_gpu_check --out $OUT/tp.json [--tp 2,4] [--model small|DIR]

For each N: the greedy tokens of the TP engine against the TP = 1 engine's and
transformers' (fp32, same weights), and the tokens per second of one batch at TP = 1
and TP = N with their ratio. An N needing more GPUs than are visible is recorded as
skipped (and so is everything without CUDA, unless `--device cpu`: the same checks on
gloo, which is how this script is tested on CPU machines).

`--one-gpu`: every rank on the one GPU, all-reduces over gloo (PDSERVE_TP_ONE_GPU=1).
NCCL refuses two ranks on one GPU, so on a one-GPU machine this is what can be checked:
the CUDA code path of the sharded model (local heads in the Triton kernels, the KV
gather from GPU caches) and its exactness, not NCCL and not the speed-up.
Exit status 1 when a run is not exact.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python tools/tp_gpu_check.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model", default="small", help="a tiny_model preset or an HF model dir")
    p.add_argument("--tp", default="2", help="comma-separated TP sizes, e.g. 2,4,8")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--one-gpu", action="store_true", help="all ranks on one GPU over gloo")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    return p.parse_args(argv)


def _model_dir(name: str) -> Path:
    from engine.tiny_model import PRESETS, make_model

    if name in PRESETS:
        return make_model(Path(tempfile.mkdtemp(prefix="tp-check-")) / name, name, "llama")
    return Path(name)


def _run(model_dir: Path, device: str, tp: int, prompts, max_tokens: int) -> dict:
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.monotonic()
    with LLM(str(model_dir), device=device, tensor_parallel_size=tp) as llm:
        start_s = time.monotonic() - t0
        llm.generate(prompts[:1], params)  # warm-up (kernels, allocator)
        t1 = time.monotonic()
        outs = llm.generate(prompts, params)
        run_s = time.monotonic() - t1
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tp": tp, "startup_s": round(start_s, 2), "tokens": tokens,
            "tok_per_s": round(tokens / run_s, 1), "token_ids": [o.token_ids for o in outs]}


def _hf(model_dir: Path, device: str, prompts, max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            g = m.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    return out


def check(args: argparse.Namespace) -> dict:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    doc: dict = {"device": args.device, "gpus": gpus, "one_gpu": args.one_gpu,
                 "model": args.model, "results": []}
    if args.device == "cuda" and gpus == 0:
        doc["skipped"] = "no CUDA device"
        return doc
    if args.device == "cuda":
        doc["gpu_name"] = torch.cuda.get_device_name(0)
    if args.one_gpu:
        os.environ["PDSERVE_TP_ONE_GPU"] = "1"  # read by the ranks too (inherited)
    model_dir = _model_dir(args.model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2000, (args.prompt_len + 7 * i,), generator=g).tolist()
               for i in range(args.prompts)]
    base = None
    for tp in (int(t) for t in args.tp.split(",")):
        need = 1 if args.one_gpu or args.device == "cpu" else tp
        if args.device == "cuda" and gpus < need:
            doc["results"].append({"tp": tp, "skipped": f"needs {need} GPUs, {gpus} visible"})
            continue
        if base is None:
            base = _run(model_dir, args.device, 1, prompts, args.max_tokens)
            hf = _hf(model_dir, args.device, prompts, args.max_tokens)
            base["exact_vs_transformers"] = base["token_ids"] == hf
            doc["tp1"] = {k: v for k, v in base.items() if k != "token_ids"}
        r = _run(model_dir, args.device, tp, prompts, args.max_tokens)
        r["exact_vs_tp1"] = r["token_ids"] == base["token_ids"]
        r["exact_vs_transformers"] = r["token_ids"] == hf
        r["speedup_vs_tp1"] = round(r["tok_per_s"] / base["tok_per_s"], 3)
        del r["token_ids"]
        doc["results"].append(r)
        print(f"TP={tp}: {r['tok_per_s']} tok/s vs TP=1 {base['tok_per_s']} tok/s "
              f"(x{r['speedup_vs_tp1']}), exact: {r['exact_vs_transformers']}", flush=True)
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = check(args)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    if "skipped" in doc:
        print(f"tp_gpu_check: skipped ({doc['skipped']})")
    ok = all(r.get("exact_vs_transformers", True) for r in doc["results"])
    ok = ok and doc.get("tp1", {}).get("exact_vs_transformers", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
