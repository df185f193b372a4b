"""The steps of tools/gpu_check, one function each: `step(ctx) -> dict` (JSON-ready).

`ctx` holds the model directory, the device ('cuda:0', or 'cpu' for the CPU-safe parts),
the dtype and `quick`. Each step runs in its own process (tools/gpu_check.py), so a step
that hangs or breaks the CUDA context costs only itself.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tools.gpu_decode_step import gpu_check_step

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Ctx:
    model_dir: str
    device: str
    dtype: str
    quick: bool
    timeout_s: float

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def _sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def _median_ms(fn: Callable[[], Any], ctx: Ctx, reps: int = 7, host_only: bool = False
               ) -> float:
    """Median ms of `fn` until the device is done with it (or, `host_only`, until `fn`
    returns: the time the calling thread is held)."""
    times = []
    for _ in range(reps):
        _sync(ctx)
        t0 = time.perf_counter()
        fn()
        if not host_only:
            _sync(ctx)
        times.append((time.perf_counter() - t0) * 1e3)
        _sync(ctx)
    return statistics.median(times)


# ---------------------------------------------------------------------------- env
def step_env(ctx: Ctx) -> dict[str, Any]:
    from cluster.launch.placement import plan_pools

    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda_available": torch.cuda.is_available(), "device": ctx.device}
    for mod in ("triton", "transformers", "ray"):
        spec = importlib.util.find_spec(mod)
        out[mod] = __import__(mod).__version__ if spec else None
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        out.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                   total_gib=total / 2**30, free_gib=free / 2**30,
                   l2_mib=getattr(p, "L2_cache_size", 0) / 2**20)
    plan = plan_pools(1, 1, device="auto", gpus_per_worker=1.0, cpus_per_worker=1.0,
                      available={"GPU": 1.0})
    out["plan_1p1d_on_one_gpu"] = {"gpus": [w.num_gpus for w in plan.workers], "note": plan.note}
    return out


# ---------------------------------------------------------------------------- tests/gpu
def step_pytest(ctx: Ctx) -> dict[str, Any]:
    xml = Path(tempfile.mkdtemp()) / "gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu",
           f"--junitxml={xml}", "-rfE"]
    if importlib.util.find_spec("xdist"):
        cmd += ["-n", "4"]  # the suite is bound by Triton compiles: spread them over cores
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=max(30, ctx.timeout_s - 15))
    out: dict[str, Any] = {"returncode": r.returncode, "wall_s": time.monotonic() - t0,
                           "tail": r.stdout[-3000:] + r.stderr[-1000:]}
    if xml.exists():
        suites = ET.parse(xml).getroot()
        suite = suites if suites.tag == "testsuite" else suites[0]
        for k in ("tests", "failures", "errors", "skipped"):
            out[k] = int(suite.get(k, 0))
        out["failed"] = [
            {"test": f"{c.get('classname')}::{c.get('name')}",
             "message": (c[0].get("message") or c[0].text or "")[:600]}
            for c in suite.iter("testcase") if len(c) and c[0].tag in ("failure", "error")]
    return out


# ---------------------------------------------------------------------------- kernels
def _paged(lens: list[int], bs: int, kvh: int, d: int, dtype, dev, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    need = [math.ceil(n / bs) for n in lens]
    k = torch.randn((sum(need) + 1, bs, kvh, d), generator=g, device=dev).to(dtype)
    v = torch.randn_like(k)
    perm = torch.randperm(sum(need) + 1, generator=g, device=dev).to(torch.int32)
    table = torch.zeros((len(lens), max(need)), dtype=torch.int32, device=dev)
    at = 0
    for s, nb in enumerate(need):
        table[s, :nb] = perm[at:at + nb]
        at += nb
    return k, v, table, torch.tensor(lens, dtype=torch.int32, device=dev)


def _err(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (out.float() - ref.float())
    return {"max_abs": diff.abs().max().item(),
            "rel_l2": (diff.norm() / ref.float().norm()).item()}


def step_kernels_bf16(ctx: Ctx) -> dict[str, Any]:
    """Triton decode and prefill in bf16 against the fp32 torch reference of the same
    rounded inputs (rel L2 < 8e-3 is the bar of tests/gpu/test_triton_attention_gpu.py)."""
    from engine.attention import torch_ref, triton_ops

    dev, rows = torch.device(ctx.device), []
    for h, kvh, d in ((32, 8, 128), (14, 2, 64)):
        lens = [1, 17, 1000, 4100, 8192]
        k, v, table, sl = _paged(lens, 16, kvh, d, torch.bfloat16, dev, seed=h)
        q = torch.randn(len(lens), h, d, device=dev).to(torch.bfloat16)
        out = triton_ops.paged_decode_attention(q, k, v, table, sl, d**-0.5)
        ref = torch_ref.paged_decode_attention(q.float(), k.float(), v.float(), table, sl,
                                               d**-0.5)
        rows.append({"kernel": "decode", "heads": f"{h}/{kvh}", "head_dim": d, **_err(out, ref)})
        chunks = [(0, 37), (45, 20), (1000, 300), (0, 700), (3000, 129)]
        k, v, table, sl = _paged([p + c for p, c in chunks], 16, kvh, d, torch.bfloat16, dev, d)
        qsl = torch.tensor([0] + [sum(c for _, c in chunks[:i + 1]) for i in range(len(chunks))],
                           dtype=torch.int32, device=dev)
        q = torch.randn(int(qsl[-1]), h, d, device=dev).to(torch.bfloat16)
        out = triton_ops.paged_prefill_attention(q, k, v, table, qsl, sl, d**-0.5)
        ref = torch_ref.paged_prefill_attention(q.float(), k.float(), v.float(), table, qsl,
                                                sl, d**-0.5)
        rows.append({"kernel": "prefill", "heads": f"{h}/{kvh}", "head_dim": d, **_err(out, ref)})
    return {"results": rows, "all_rel_l2_below_8e-3": all(r["rel_l2"] < 8e-3 for r in rows)}


# ---------------------------------------------------------------------------- KV export
def step_kv_export(ctx: Ctx) -> dict[str, Any]:
    """Per chunk of an 8B-shaped cache (32 layers x 8 KV heads x 128, bf16: 128 KiB a
    token): export and import now (one gather, pinned, side stream) vs the previous
    per-layer path (64 index_selects, blocking copies to fresh pageable memory)."""
    from engine.config import ModelConfig
    from engine.kv_cache import KVCache, slots_for

    model = ModelConfig("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 8192,
                        False, False, False, False, False)
    dev, dtype, bs = torch.device(ctx.device), torch.bfloat16, 16
    tokens = [256, 1024] if ctx.cuda else [64]
    num_blocks = 2 * max(tokens) // bs + 8
    kv = KVCache(model, num_blocks, bs, dtype, dev)
    kv.data.normal_()
    rows = []
    for t in tokens:
        blocks = torch.randperm(num_blocks)[: t // bs].tolist()
        idx = torch.tensor(slots_for(blocks, 0, t, bs), device=dev)

        def old_export(t=t, idx=idx):
            out = torch.empty((model.num_layers, 2, t, 8, 128), dtype=dtype)
            for layer in range(model.num_layers):
                out[layer, 0] = kv.k[layer].view(-1, 8, 128).index_select(0, idx).cpu()
                out[layer, 1] = kv.v[layer].view(-1, 8, 128).index_select(0, idx).cpu()
            return out

        payload = kv.export_tokens(blocks, 0, t)
        assert torch.equal(payload, old_export()), "export differs from the per-layer path"
        host = payload.clone()  # pageable, as a receiver hands it over
        nbytes = payload.numel() * payload.element_size()
        row = {"tokens": t, "bytes": nbytes,
               "export_ms": _median_ms(lambda b=blocks, t=t: kv.export_tokens(b, 0, t), ctx),
               "export_host_ms": _median_ms(lambda b=blocks, t=t: kv.export_async(b, 0, t),
                                            ctx, host_only=True),
               "old_export_ms": _median_ms(old_export, ctx),
               "import_ms": _median_ms(lambda b=blocks, h=host: kv.import_tokens(b, 0, h), ctx),
               "import_host_ms": _median_ms(lambda b=blocks, h=host: kv.import_tokens(b, 0, h),
                                            ctx, host_only=True)}
        row["export_GBps"] = nbytes / row["export_ms"] / 1e6
        row["speedup_vs_old"] = row["old_export_ms"] / row["export_ms"]
        rows.append(row)
    return {"shape": "32 layers x 8 KV heads x 128, bf16 (Llama-3-8B)", "results": rows}


# ---------------------------------------------------------------------------- engine
def _variants() -> dict[str, int]:
    from engine.attention import triton_decode, triton_ops, triton_prefill

    fns = {"decode": triton_decode._decode_kernel, "reduce": triton_decode._decode_reduce_kernel,
           "prefill": triton_prefill._prefill_kernel, "write_kv": triton_ops._write_kv_kernel}
    return {k: sum(len(e[0]) for e in getattr(f, "device_caches", {}).values())
            for k, f in fns.items()}


def step_engine(ctx: Ctx) -> dict[str, Any]:
    """engine.LLM eager output tok/s, greedy and sampled (T=1, top-p 0.9, top-k 50)."""
    from engine import LLM, SamplingParams
    from tools.gpu_check_service import workload

    t0 = time.monotonic()
    llm = LLM(ctx.model_dir, device=ctx.device, dtype=ctx.dtype, max_num_batched_tokens=2048,
              max_num_seqs=128, max_prefill_chunk=512, max_model_len=4096,
              num_blocks=None if ctx.cuda else 512)
    out: dict[str, Any] = {"startup_s": time.monotonic() - t0, "kv_blocks": llm.runner.num_blocks,
                           "backend": llm.runner.backend.name}
    compiled = _variants()
    n, hi, new = (8, 64, 8) if not ctx.cuda else ((32, 512, 64) if ctx.quick else (64, 1024, 128))
    wl = workload(llm.config.model.vocab_size, n, 16, hi, new)
    llm.generate(wl.prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    for name, sp in (("greedy", wl.params),
                     ("sampled", SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                max_tokens=new, ignore_eos=True))):
        steps0, t0 = llm.num_steps, time.monotonic()
        outs = llm.generate(wl.prompts, sp)
        wall = time.monotonic() - t0
        toks = sum(len(o.token_ids) for o in outs)
        out[name] = {"output_tokens": toks, "wall_s": wall, "output_tok_s": toks / wall,
                     "steps": llm.num_steps - steps0,
                     "mean_step_ms": 1e3 * wall / max(1, llm.num_steps - steps0)}
    out["sampled_over_greedy"] = out["sampled"]["output_tok_s"] / out["greedy"]["output_tok_s"]
    out["kernel_variants_after_warmup"] = compiled
    out["kernel_variants_compiled_while_serving"] = {
        k: v - compiled[k] for k, v in _variants().items()}
    llm.block_manager.check_integrity()
    out["kv_blocks_used_at_end"] = llm.block_manager.num_used_blocks
    return out


def step_service(ctx: Ctx) -> dict[str, Any]:
    from engine.loader import load_model_config
    from tools.gpu_check_service import service_step, workload

    vocab = load_model_config(ctx.model_dir).vocab_size
    n, hi, new = (6, 64, 6) if not ctx.cuda else ((24, 512, 48) if ctx.quick else (48, 1024, 96))
    return service_step(ctx.model_dir, ctx.device, ctx.dtype, workload(vocab, n, 16, hi, new))


def step_attention_bw(ctx: Ctx) -> dict[str, Any]:
    from tools import attention_bw

    doc = attention_bw.run(["--quick", "--copy-gib", "2"])
    return doc if doc is not None else {"skipped": "attention_bw needs CUDA and Triton"}


STEPS: dict[str, tuple[Callable[[Ctx], dict[str, Any]], float, bool]] = {
    # name: (function, time limit in s, needs CUDA)
    "env": (step_env, 60, False),
    "pytest": (step_pytest, 240, True),
    "kernels_bf16": (step_kernels_bf16, 60, True),
    "kv_export": (step_kv_export, 60, False),
    "engine": (step_engine, 120, False),
    "compiled_decode": (gpu_check_step, 240, True),  # tools/gpu_decode_step.py
    "service": (step_service, 180, False),
    "attention_bw": (step_attention_bw, 120, True),
}
