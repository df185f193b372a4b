"""engine.LLM vs transformers on one machine, side by side, same model, same threads.

Workload: N prompts with seeded random lengths in [min_len, max_len] and random token ids,
each generating exactly `output_len` tokens (greedy, EOS ignored). Figures are output
tokens per second of wall time for:

- engine       `engine.LLM.generate` (paged KV, chunked prefill, continuous batching)
- hf-padded    transformers `model.generate` on left-padded batches (how most users call it)
- hf-cb        transformers' own continuous batching, `model.generate_batch` (paged cache)

It also prints the engine's decode step time at batch 1 as a fraction of the memory-
bandwidth roof and a prefill chunk's time as a fraction of the compute roof, both measured
in the same run (bench/roofline.py). `--compile none,auto` runs one engine peer per
compile mode (eager and compiled side by side).

Wall time is the figure; each peer's process CPU time is printed too, because on a shared
machine other processes stretch wall time (with one thread, CPU time is the work done).

    python -m bench.engine_vs_hf --quick            # a couple of minutes
    python -m bench.engine_vs_hf --json out.json    # the full workload (10+ min on 2 cores)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

PEERS = ("engine", "hf-padded", "hf-cb")
_echo = functools.partial(print, flush=True)
PRESET, ARCH = "qwen2-0.5b-shape", "qwen2"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_vs_hf",
        description="Output tokens/s of engine.LLM vs transformers generate (padded batch) "
        "and transformers continuous batching, on the same model and thread count.",
    )
    p.add_argument("--model-dir", default=None,
                   help=f"HF model directory (default: the {PRESET} model in "
                   "~/.cache/pdserve/models, written there if absent)")
    p.add_argument("--num-prompts", type=int, default=32, help="number of prompts (default 32)")
    p.add_argument("--min-len", type=int, default=32, help="shortest prompt, tokens (default 32)")
    p.add_argument("--max-len", type=int, default=1024,
                   help="longest prompt, tokens (default 1024)")
    p.add_argument("--output-len", type=int, default=64,
                   help="tokens generated per prompt, EOS ignored (default 64)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for every peer (default: torch's default, "
                   "the number of physical cores)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated subset of {','.join(PEERS)} (default: all)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget per step for the engine and for hf-cb (default 512)")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="prompts per padded transformers generate call (default: all at once)")
    p.add_argument("--decode-steps", type=int, default=8,
                   help="batch-1 decode steps timed for the roofline figure (default 8; 0 skips)")
    p.add_argument("--compile", default="auto",
                   help="engine compile mode(s) (auto, none, decode, all), comma-separated: "
                   "each runs as its own engine peer, e.g. none,auto (default auto)")
    p.add_argument("--quick", action="store_true",
                   help="small workload (8 prompts of 32..256 tokens, 16 output tokens) that "
                   "finishes in a couple of minutes")
    p.add_argument("--json", metavar="OUT", default=None, help="also write all figures to OUT")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.min_len, args.max_len, args.output_len = 8, 32, 256, 16
        args.decode_steps = min(args.decode_steps, 4)
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    bad = [x for x in peers if x not in PEERS]
    if bad or not peers:
        p.error(f"--peers: unknown {bad}; choose from {PEERS}")
    modes = [m.strip() for m in args.compile.split(",") if m.strip()]
    if len(modes) > 1 and "engine" in peers:  # one engine peer per compile mode
        i = peers.index("engine")
        peers[i:i + 1] = [f"engine[{m}]" for m in modes]
    args.compile_modes = modes
    args.peers = peers
    if not 1 <= args.min_len <= args.max_len:
        p.error("--min-len must be >= 1 and <= --max-len")
    for name in ("num_prompts", "output_len", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    return [rng.integers(1, vocab, size=int(L)).tolist() for L in lengths]


def run_engine(model_dir, prompts, args, result: dict, mode: str = "auto") -> list[list[int]]:
    from bench import roofline
    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), max_num_seqs=len(prompts),
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max(len(p) for p in prompts) + args.output_len + 1, compile=mode)
    result["load_s"] = time.perf_counter() - t0
    result["compile"] = (f"{llm.runner.compiled.report.line()}; attention "
                         f"{llm.runner.backend.name}")
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([prompts[0][:8]], warm)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp)
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t, time.process_time() - c
    result["steps"] = llm.num_steps
    assert llm.block_manager.num_used_blocks == 0
    if args.decode_steps:  # decode at batch 1 and a prefill chunk against the roofs
        chunk = min(512, args.max_num_batched_tokens, llm.config.scheduler.max_model_len - 1)
        times = roofline.step_times(llm, prompts[0], args.decode_steps, chunk)
        result["roofline"] = roofline.roofs(llm, times)
    return [o.token_ids for o in outs]


def _hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def run_hf_padded(model_dir, prompts, args, result: dict) -> list[list[int]]:
    import torch

    t0 = time.perf_counter()
    model = _hf_model(model_dir)
    result["load_s"] = time.perf_counter() - t0
    pad = model.generation_config.pad_token_id or model.config.eos_token_id or 0
    bs = args.hf_batch_size or len(prompts)
    result["batch_size"] = bs

    def generate(batch: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=pad)
        return out[:, width:].tolist()

    generate([prompts[0][:8]], 2)  # warm-up
    t, c = time.perf_counter(), time.process_time()
    outs: list[list[int]] = []
    for i in range(0, len(prompts), bs):
        outs += generate(prompts[i : i + bs], args.output_len)
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t, time.process_time() - c
    result["padded_prompt_tokens"] = sum(
        len(prompts[i : i + bs]) * max(len(p) for p in prompts[i : i + bs])
        for i in range(0, len(prompts), bs))
    return outs


def run_hf_cb(model_dir, prompts, args, result: dict) -> list[list[int]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    t0 = time.perf_counter()
    model = _hf_model(model_dir)
    result["load_s"] = time.perf_counter() - t0
    page = 256  # transformers' default page size
    per_seq = -(-(max(len(p) for p in prompts) + args.output_len) // page)
    cb = ContinuousBatchingConfig(
        num_blocks=per_seq * len(prompts) + 4,  # room for every request at once
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=len(prompts),
    )
    result["attn_implementation"] = model.config._attn_implementation

    def generate(batch: list[list[int]], n: int) -> list[list[int]]:
        gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1,
                               pad_token_id=0)
        out = model.generate_batch(batch, generation_config=gen, continuous_batching_config=cb)
        return [list(o.generated_tokens) for o in out.values()]

    generate([prompts[0][:8]], 2)  # warm-up
    t, c = time.perf_counter(), time.process_time()
    outs = generate(prompts, args.output_len)
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t, time.process_time() - c
    return outs


RUNNERS = {"engine": run_engine, "hf-padded": run_hf_padded, "hf-cb": run_hf_cb}


def main(argv: list[str] | None = None) -> dict:
    return compare(parse_args(argv))


def compare(args: argparse.Namespace, echo: Callable[[str], None] = _echo) -> dict:
    """Run every peer of ``args.peers`` on the same prompts; ``echo`` gets each printed
    line (the figures, ratios and roofline); returns the report (``--json``'s content)."""
    if args.threads is not None:  # before torch starts its pools
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    import torch

    from bench import roofline
    from engine.loader import load_model_config

    if args.threads is None:
        args.threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    model_dir = roofline.resolve_model(args.model_dir, PRESET)
    cfg = load_model_config(model_dir)
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, cfg.vocab_size,
                           args.seed)
    n_prompt = sum(len(p) for p in prompts)
    echo(f"model {model_dir} ({cfg.architecture}, {cfg.num_layers} layers, "
         f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}), fp32, {args.threads} threads, "
         f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    echo(f"workload: {len(prompts)} prompts, {n_prompt} prompt tokens "
         f"(lengths {args.min_len}..{args.max_len}, seed {args.seed}), "
         f"{args.output_len} output tokens each")
    report: dict = {"args": {k: v for k, v in vars(args).items()}, "model_dir": str(model_dir),
                    "prompt_tokens": n_prompt, "peers": {}}
    outputs: dict[str, list[list[int]]] = {}
    for name in args.peers:
        res: dict = {}
        print(f"running {name} ...", file=sys.stderr, flush=True)  # minutes each, full size
        if name.startswith("engine["):
            outputs[name] = run_engine(model_dir, prompts, args, res, name[7:-1])
        else:
            outputs[name] = RUNNERS[name](model_dir, prompts, args, res,
                                          **({"mode": args.compile_modes[0]}
                                             if name == "engine" else {}))
        gc.collect()  # the peer's model goes before the next one loads
        torch.set_num_threads(args.threads)
        n_out = sum(len(o) for o in outputs[name])
        res["output_tokens"] = n_out
        res["output_tok_s"] = n_out / res["wall_s"]
        res["total_tok_s"] = (n_out + n_prompt) / res["wall_s"]
        report["peers"][name] = res
        echo(f"{name:10s} {res['output_tok_s']:8.2f} output tok/s  "
             f"{'(' + res['compile'] + ') ' if 'compile' in res else ''}"
             f"({n_out} tokens in {res['wall_s']:.1f} s wall, {res['cpu_s']:.1f} s CPU; "
             f"prompt+output {res['total_tok_s']:.1f} tok/s; load {res['load_s']:.1f} s)")
        if n_out != len(prompts) * args.output_len:
            echo(f"  warning: {name} produced {n_out} tokens, expected "
                 f"{len(prompts) * args.output_len}")
    engines = [n for n in outputs if n.startswith("engine")]
    for e in engines:
        tag = "" if len(engines) == 1 else f"{e} "
        key = "" if len(engines) == 1 else f"{e}_"
        for name in outputs:
            if name not in engines:
                same = sum(a == b for a, b in zip(outputs[e], outputs[name], strict=True))
                report["peers"][name][f"greedy_equal_to_{e}"] = same
                echo(f"{name}: greedy outputs equal to the {e}'s for {same}/{len(prompts)} "
                     "prompts")
        eng = report["peers"][e]
        for name in outputs:
            if name not in engines:
                peer = report["peers"][name]
                ratio = eng["output_tok_s"] / peer["output_tok_s"]
                cpu_ratio = peer["cpu_s"] / eng["cpu_s"]
                report[f"ratio_{key}vs_{name}"] = ratio
                report[f"cpu_ratio_{key}vs_{name}"] = cpu_ratio
                echo(f"{tag}ratio vs {name}: {ratio:.2f}  (CPU-time ratio {cpu_ratio:.2f})")
        if "roofline" in eng:
            for line in roofline.lines(eng["roofline"]):
                echo(f"{tag}{line}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        echo(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
