"""The engine's step against the machine's roofs, measured in the same run.

- Decode at batch 1 must read every weight once: it cannot beat
  `weight bytes / bandwidth`, with bandwidth measured by a large memcpy (STREAM convention:
  bytes read + bytes written per second): the median of probes taken between the timed
  decode steps, so a busy moment of a shared machine moves the roof less. A decode step
  only reads, and on a machine whose cores each sustain a bounded number of outstanding
  reads (2 cores here), a pure read stream runs slower than memcpy's read + write count:
  the read-only rate (a sum over the same bytes, probed alike) gives the floor a GEMV
  could reach, printed beside it.
- A prefill chunk must do its FLOPs: `2 x linear params` per token, the causal attention
  (QK^T and PV over the keys each query sees) and the logits of its one sampled row; it
  cannot beat `FLOPs / GEMM rate`, with the rate that of fp32 GEMMs measured here (the
  best of a 1024^3 product and the chunk's largest projection, `[C, hidden] x
  [hidden, 2 x intermediate]`).

Both step times go through `engine.LLM` (scheduler, runner and sampler included).

    python -m bench.roofline --model-dir DIR [--compile none,auto] [--threads 2] [--chunk 512]

`--model-dir` also takes `smollm2` (the real model) or a tiny_model preset name such as
`qwen2-0.5b-shape` (written once to ~/.cache/pdserve/models).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.quantiles import median


class BandwidthProbe:
    """Memory bandwidth of this process's threads, probed many times (between the timed
    steps, `step_times`) rather than once: on a shared machine one probe read 28 GB/s in
    one session and 50 GB/s in the next. Each probe is the best of `repeats` passes over
    `nbytes`; the figures are the medians over probes."""

    def __init__(self, nbytes: int = 512 << 20, repeats: int = 2):
        import torch

        self.nbytes, self.repeats = nbytes, repeats
        self.src = torch.ones(nbytes // 4, dtype=torch.float32)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # fault the pages in
        self.copy_rates: list[float] = []
        self.read_rates: list[float] = []

    def _best(self, fn) -> float:
        best = float("inf")
        for _ in range(self.repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    def probe(self) -> None:
        """One memcpy probe (read + write bytes / s, STREAM convention) and one read-only
        probe (a sum over the same bytes)."""
        self.copy_rates.append(2 * self.nbytes / self._best(lambda: self.dst.copy_(self.src)))
        self.read_rates.append(self.nbytes / self._best(self.src.sum))

    def medians(self) -> tuple[float, float]:
        if not self.copy_rates:
            self.probe()
        return median(self.copy_rates), median(self.read_rates)


def gemm_rate(shapes: list[tuple[int, int, int]], repeats: int = 5) -> float:
    """Best fp32 GEMM FLOP/s over `shapes` (m, k, n) of `[m, k] x [k, n]`."""
    import torch

    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b  # warm-up
        t_best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            t_best = min(t_best, time.perf_counter() - t)
        best = max(best, 2 * m * k * n / t_best)
    return best


def weight_bytes(model) -> int:
    params = {id(p): p for p in model.parameters()}  # tied weights once
    return sum(p.numel() * p.element_size() for p in params.values())


def prefill_flops(cfg, chunk: int, context: int = 0) -> float:
    """FLOPs of one prefill chunk of `chunk` tokens after `context` cached ones."""
    h, kvh, d, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    linear = hid * (h + 2 * kvh) * d + h * d * hid + 3 * hid * cfg.intermediate_size
    keys = chunk * context + chunk * (chunk + 1) // 2  # causal: query i sees context + i + 1
    attention = 4 * h * d * keys  # QK^T and PV
    return cfg.num_layers * (2 * linear * chunk + attention) + 2 * hid * cfg.vocab_size


@dataclass
class StepTimes:
    decode_b1_s: float
    prefill_chunk_s: float
    chunk: int
    bandwidth: BandwidthProbe


def step_times(llm, prompt: list[int], decode_steps: int = 8, chunk: int = 512) -> StepTimes:
    """Median batch-1 decode step (after a 16-token prompt) and the best of three prefill
    steps of one `chunk`-token prompt (one chunk: the engine's budget must allow it), all
    through `llm.step()`, with a bandwidth probe after every decode step (untimed); the
    engine must be idle."""
    from engine import SamplingParams

    if llm.has_unfinished():
        raise ValueError("step_times needs an idle engine")
    bandwidth = BandwidthProbe()
    r = llm.add_request(prompt[:16], SamplingParams(
        temperature=0.0, max_tokens=decode_steps + 2, ignore_eos=True))
    while r.status.name in ("WAITING", "PREFILLING"):
        llm.step()
    times = []
    while llm.has_unfinished():
        t = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t)
        bandwidth.probe()
    decode = median(times)
    long = (prompt * (chunk // max(1, len(prompt)) + 1))[:chunk]
    best = float("inf")
    for i in range(3):  # distinct first tokens: no prefix-cache hits
        req = llm.add_request([1 + i] + long[1:], SamplingParams(max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        llm.step()
        best = min(best, time.perf_counter() - t)
        if not req.is_finished:  # the chunk did not fit one step: count no figure
            llm.abort(req.request_id)
            best = float("nan")
            break
    return StepTimes(decode, best, chunk, bandwidth)


def roofs(llm, times: StepTimes) -> dict:
    """Both roofs for this engine's model, measured now, and the step times against them."""
    cfg = llm.config.model
    wbytes = weight_bytes(llm.runner.model)
    bw, read = times.bandwidth.medians()
    flops = prefill_flops(cfg, times.chunk)
    rate = gemm_rate([(1024, 1024, 1024),
                      (times.chunk, cfg.hidden_size, 2 * cfg.intermediate_size)])
    decode_roof, prefill_roof = wbytes / bw, flops / rate
    return {"weight_bytes": wbytes, "memcpy_bytes_per_s": bw, "read_bytes_per_s": read,
            "bandwidth_probes": len(times.bandwidth.copy_rates),
            "memcpy_probe_range": [min(times.bandwidth.copy_rates),
                                   max(times.bandwidth.copy_rates)],
            "decode_read_floor_s": wbytes / read,
            "decode_b1_step_s": times.decode_b1_s, "decode_roof_s": decode_roof,
            "decode_fraction_of_roof": decode_roof / times.decode_b1_s,
            "prefill_chunk_tokens": times.chunk, "prefill_flops": flops,
            "gemm_flops_per_s": rate, "prefill_chunk_s": times.prefill_chunk_s,
            "prefill_roof_s": prefill_roof,
            "prefill_fraction_of_roof": prefill_roof / times.prefill_chunk_s}


def lines(r: dict) -> list[str]:
    return [
        f"decode step at batch 1: {1e3 * r['decode_b1_step_s']:.1f} ms; roof "
        f"{1e3 * r['decode_roof_s']:.1f} ms ({r['weight_bytes'] / 1e9:.2f} GB of weights at "
        f"{r['memcpy_bytes_per_s'] / 1e9:.1f} GB/s memcpy, median of {r['bandwidth_probes']} "
        f"probes in {r['memcpy_probe_range'][0] / 1e9:.0f}..{r['memcpy_probe_range'][1] / 1e9:.0f})"
        " -> "
        f"{100 * r['decode_fraction_of_roof']:.0f}% of the bandwidth roof "
        f"({1 / r['decode_fraction_of_roof']:.2f}x); read-only floor "
        f"{1e3 * r['decode_read_floor_s']:.1f} ms at {r['read_bytes_per_s'] / 1e9:.1f} GB/s "
        f"({r['decode_b1_step_s'] / r['decode_read_floor_s']:.2f}x)",
        f"prefill chunk of {r['prefill_chunk_tokens']} tokens: "
        f"{1e3 * r['prefill_chunk_s']:.1f} ms; roof {1e3 * r['prefill_roof_s']:.1f} ms "
        f"({r['prefill_flops'] / 1e9:.1f} GFLOP at {r['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"measured fp32 GEMM) -> {100 * r['prefill_fraction_of_roof']:.0f}% of the compute "
        f"roof ({1 / r['prefill_fraction_of_roof']:.2f}x)",
    ]


def resolve_model(name: str | None, default: str = "qwen2-0.5b-shape") -> Path:
    """A model directory, `smollm2` (the real model) or a tiny_model preset name."""
    name = name or default
    if Path(name, "config.json").exists():
        return Path(name)
    from engine.model_fetch import REAL_MODELS, ensure_real_model
    from engine.tiny_model import PRESETS, ensure_model

    if name in REAL_MODELS:
        return ensure_real_model(name)
    if name in PRESETS:
        return ensure_model(name, "qwen2" if name.startswith("qwen2") else "llama")
    raise SystemExit(f"--model-dir {name!r}: not a model directory, a real model "
                     f"{tuple(REAL_MODELS)} or a preset {tuple(PRESETS)}")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--model-dir", default=None, help="model directory, smollm2, or a preset")
    p.add_argument("--compile", default="none,auto", help="engine compile modes, compared")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens (default 512)")
    p.add_argument("--decode-steps", type=int, default=8)
    args = p.parse_args(argv)
    if args.threads:  # before torch starts its pools
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    from engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model_dir)
    out = []
    for mode in [m.strip() for m in args.compile.split(",") if m.strip()]:
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), compile=mode, max_num_batched_tokens=max(512, args.chunk),
                  max_model_len=args.chunk + 64, max_num_seqs=16)
        start = time.perf_counter() - t0
        rng = torch.Generator().manual_seed(0)
        prompt = torch.randint(1, llm.config.model.vocab_size, (args.chunk,),
                               generator=rng).tolist()
        r = roofs(llm, step_times(llm, prompt, args.decode_steps, args.chunk))
        r.update(compile=mode, compile_report=llm.runner.compiled.report.line(), startup_s=start)
        print(f"[compile {mode}] {r['compile_report']} (start-up {start:.1f} s)")
        for line in lines(r):
            print(f"[compile {mode}] {line}", flush=True)
        out.append(r)
        del llm
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
