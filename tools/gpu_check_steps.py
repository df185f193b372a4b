"""The steps of tools/gpu_check, one function each: `step(ctx) -> dict` (JSON-ready), and
PLAN, the order they run in with their time limits (see tools/gpu_check.py for the
budget rules).

`ctx` holds the model directory, the device ('cuda:0', or 'cpu' for the CPU-safe parts),
the dtype, `quick`, the step's time limit and a work directory the steps of one run share.
Each step runs in its own process group (tools/gpu_check.py), so a step that hangs or
breaks the CUDA context costs only itself. A result with a non-empty `failed_checks`
(a list of sentences) fails its step though the step ran to its end.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tools.gpu_check import end_group
from tools.gpu_check_plan import Ctx

ROOT = Path(__file__).resolve().parents[1]
PYTEST_TEST_TIMEOUT_S = 60
PYTEST_TARGET = "tests/gpu"
PYTEST_WORKERS = 4  # xdist's, where it is installed: the suite is bound by Triton compiles
# what the steps import beyond torch and the standard library
NEEDED_MODULES = ("triton", "transformers", "safetensors", "tokenizers", "numpy", "msgpack",
                  "xxhash", "yaml", "grpc", "google.protobuf", "prometheus_client", "pytest",
                  "pytest_timeout", "psutil")


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
    # what the steps import beyond torch (the GPU image has them; ray is not needed)
    out["missing_modules"] = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        out.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                   total_gib=total / 2**30, free_gib=free / 2**30,
                   l2_mib=getattr(p, "L2_cache_size", 0) / 2**20)
    plan = plan_pools(1, 1, device="auto", gpus_per_worker=1.0, cpus_per_worker=1.0,
                      available={"GPU": 1.0})
    out["plan_1p1d_on_one_gpu"] = {"gpus": [w.num_gpus for w in plan.workers], "note": plan.note}
    if out["missing_modules"]:
        out["failed_checks"] = [f"modules missing: {', '.join(out['missing_modules'])}"]
    return out


# ---------------------------------------------------------------------------- model
def step_model(ctx: Ctx) -> dict[str, Any]:
    """Write the preset's model directory (random weights) where the other steps read it."""
    from tools.gpu_check import write_model

    t0 = time.monotonic()
    d = write_model(ctx.model_dir)
    size = sum(f.stat().st_size for f in Path(d).iterdir() if f.is_file())
    return {"model_dir": d, "bytes": size, "wall_s": time.monotonic() - t0}


# ---------------------------------------------------------------------------- tests/gpu
def _count_progress(text: str) -> dict[str, int]:
    """Counts from pytest's summary line, or, in a run killed before it, from its progress
    lines (`..F.s  [ 40%]`: one character a test)."""
    out: dict[str, int] = {}
    for line in text.splitlines()[::-1]:
        found = re.findall(r"(\d+) (passed|failed|errors?|skipped)", line)
        if found and ("=" in line or " in " in line):
            for n, what in found:
                out[what.rstrip("s") if what.startswith("error") else what] = int(n)
            return out
    marks = "".join(m.group(1) for line in text.splitlines()
                    if (m := re.match(r"^([.FEsxX]+)(\s+\[\s*\d+%\])?\s*$", line)))
    for ch, what in ((".", "passed"), ("F", "failed"), ("E", "error"), ("s", "skipped")):
        if marks.count(ch):
            out[what] = marks.count(ch)
    return out


def step_pytest(ctx: Ctx) -> dict[str, Any]:
    """tests/gpu, each test under pytest-timeout's limit, the whole under this step's own
    deadline: on it pytest's process group is killed and its output kept."""
    work = Path(ctx.work_dir or tempfile.mkdtemp())
    xml, log = work / "pytest.xml", work / "pytest.out"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", PYTEST_TARGET,
           f"--junitxml={xml}", "-rfE"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd += [f"--timeout={PYTEST_TEST_TIMEOUT_S}"]
    if PYTEST_WORKERS and importlib.util.find_spec("xdist"):
        cmd += ["-n", str(PYTEST_WORKERS)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    deadline = max(5.0, ctx.timeout_s - 15)  # before the step's own limit: keep the output
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        record_pgid(ctx, proc.pid)  # the check kills it too if this step is killed
        try:
            rc: int | None = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            rc = None
        end_group(proc)  # (also xdist workers that outlived a finished run)
    text = log.read_text(errors="replace")
    out: dict[str, Any] = {"returncode": rc, "timed_out": rc is None,
                           "wall_s": time.monotonic() - t0, "tail": text[-4000:]}
    out.update(_count_progress(text))
    if xml.exists() and rc is not None:
        suites = ET.parse(xml).getroot()
        suite = suites if suites.tag == "testsuite" else suites[0]
        for k in ("tests", "failures", "errors", "skipped"):
            out[k] = int(suite.get(k, 0))
        out["failed"] = [
            {"test": f"{c.get('classname')}::{c.get('name')}",
             "message": (c[0].get("message") or c[0].text or "")[:600]}
            for c in suite.iter("testcase") if len(c) and c[0].tag in ("failure", "error")]
    checks = []
    if rc is None:
        checks.append(f"pytest did not finish in {deadline:.0f} s (killed; output kept)")
    elif rc == 5:
        checks.append("pytest ran no test (exit code 5)")
    elif rc != 0:
        checks.append(f"pytest exit code {rc}: {out.get('failures', '?')} failed, "
                      f"{out.get('errors', 0)} errors")
    if checks:
        out["failed_checks"] = checks
    return out


def record_pgid(ctx: Ctx, pgid: int) -> None:
    """Name a process group this step started in its own session, for the check to end
    with the step (tools/gpu_check.py reads `<work_dir>/pgids`)."""
    if ctx.work_dir:
        with (Path(ctx.work_dir) / "pgids").open("a") as f:
            f.write(f"{pgid}\n")


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
        if ctx.cuda:  # a chunk received into the pool's pinned buffer: no staging copy
            from kv_transfer.buffers import BufferPool

            raw = BufferPool(1 << 30).get(nbytes)
            pinned = raw.view(dtype).view(payload.shape).copy_(payload)
            row["import_pinned_ms"] = _median_ms(
                lambda b=blocks, p=pinned: kv.import_tokens(b, 0, p), ctx)
            row["import_pinned_host_ms"] = _median_ms(
                lambda b=blocks, p=pinned: kv.import_tokens(b, 0, p), ctx, host_only=True)
            row["receive_buffer_pinned"] = raw.is_pinned()
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

    t0 = time.monotonic()
    llm = LLM(ctx.model_dir, device=ctx.device, dtype=ctx.dtype, max_num_batched_tokens=2048,
              max_num_seqs=128, max_prefill_chunk=512, max_model_len=4096,
              num_blocks=None if ctx.cuda else 512)
    out: dict[str, Any] = {"startup_s": time.monotonic() - t0, "kv_blocks": llm.runner.num_blocks,
                           "backend": llm.runner.backend.name}
    print(f"engine: started in {out['startup_s']:.1f} s", flush=True)  # (a cut-off run
    compiled = _variants()  # keeps its log: these lines say how far it got)
    wl = _engine_workload(ctx, llm.config.model.vocab_size)
    llm.generate(wl.prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    print(f"engine: warmed up at {time.monotonic() - t0:.1f} s", flush=True)
    for name, sp in (("greedy", wl.params),
                     ("sampled", SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                max_tokens=wl.params.max_tokens,
                                                ignore_eos=True))):
        steps0, t0 = llm.num_steps, time.monotonic()
        outs = llm.generate(wl.prompts, sp)
        wall = time.monotonic() - t0
        toks = sum(len(o.token_ids) for o in outs)
        out[name] = {"output_tokens": toks, "wall_s": wall, "output_tok_s": toks / wall,
                     "steps": llm.num_steps - steps0,
                     "mean_step_ms": 1e3 * wall / max(1, llm.num_steps - steps0)}
        print(f"engine: {name} {json.dumps(out[name])}", flush=True)
        if name == "greedy" and ctx.work_dir:  # what the compiled engine is compared with
            (Path(ctx.work_dir) / "engine_greedy.json").write_text(json.dumps(
                {"tokens": [o.token_ids for o in outs], "output_tok_s": toks / wall}))
    out["sampled_over_greedy"] = out["sampled"]["output_tok_s"] / out["greedy"]["output_tok_s"]
    out["kernel_variants_after_warmup"] = compiled
    out["kernel_variants_compiled_while_serving"] = {
        k: v - compiled[k] for k, v in _variants().items()}
    llm.block_manager.check_integrity()
    out["kv_blocks_used_at_end"] = llm.block_manager.num_used_blocks
    return out


def _engine_workload(ctx: Ctx, vocab: int):
    from tools.gpu_check_service import workload

    n, hi, new = (8, 64, 8) if not ctx.cuda else ((32, 512, 64) if ctx.quick else (64, 1024, 128))
    return workload(vocab, n, 16, hi, new)


def step_engine_compiled(ctx: Ctx) -> dict[str, Any]:
    """The engine with compile="decode" (CUDA graphs per decode bucket, recorded at
    start-up): its start-up, greedy tok/s beside the eager engine's (the engine step's,
    same workload), and that serving traced no graph again (dynamo's counters) and kept
    the compiled step on."""
    from torch._dynamo.utils import counters

    from engine import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(ctx.model_dir, device=ctx.device, dtype=ctx.dtype, compile="decode",
              max_num_batched_tokens=2048, max_num_seqs=64, max_prefill_chunk=512,
              max_model_len=4096, num_blocks=None if ctx.cuda else 512)
    rep = llm.runner.compiled.report
    out: dict[str, Any] = {"startup_s": time.monotonic() - t0, "compile": rep.line(),
                           "graphs": list(rep.graphs), "compile_s": rep.compile_s}
    print(f"engine_compiled: started in {out['startup_s']:.1f} s: {rep.line()}", flush=True)
    graphs0 = counters["stats"]["unique_graphs"]
    wl = _engine_workload(ctx, llm.config.model.vocab_size)
    llm.generate(wl.prompts[:2], SamplingParams(temperature=0, max_tokens=4))
    steps0, t1 = llm.num_steps, time.monotonic()
    outs = llm.generate(wl.prompts, wl.params)
    wall = time.monotonic() - t1
    toks = sum(len(o.token_ids) for o in outs)
    out["greedy"] = {"output_tokens": toks, "wall_s": wall, "output_tok_s": toks / wall,
                     "steps": llm.num_steps - steps0}
    out["graphs_traced_while_serving"] = counters["stats"]["unique_graphs"] - graphs0
    out["mode_after_serving"] = llm.runner.compiled.mode
    eager = Path(ctx.work_dir or "/nonexistent") / "engine_greedy.json"
    if eager.exists():
        ref = json.loads(eager.read_text())
        same = sum(a == o.token_ids for a, o in zip(ref["tokens"], outs, strict=True))
        out["greedy_equal_to_eager"] = f"{same}/{len(outs)}"
        out["over_eager_tok_s"] = out["greedy"]["output_tok_s"] / ref["output_tok_s"]
    checks = []
    if rep.mode != "decode" or out["mode_after_serving"] != "decode":
        checks.append(f"the compiled step is off: {rep.fallback_reason}")
    if out["graphs_traced_while_serving"]:
        checks.append(f"{out['graphs_traced_while_serving']} graphs traced again while "
                      "serving (after the start-up warm-up)")
    llm.block_manager.check_integrity()
    if llm.block_manager.num_used_blocks:
        checks.append(f"{llm.block_manager.num_used_blocks} KV blocks leaked")
    if checks:
        out["failed_checks"] = checks
    return out


def step_tp_one_gpu(ctx: Ctx) -> dict[str, Any]:
    """TP = 2 with both ranks on the one GPU (gloo all-reduces): rank 0's start-up with
    the kernel warm-up on CUDA, the sharded model's CUDA path and its greedy exactness
    against TP = 1 and transformers (tools/tp_gpu_check.py --one-gpu; the tiny model)."""
    from tools import tp_gpu_check

    doc = tp_gpu_check.check(tp_gpu_check.parse_args(
        ["--out", os.devnull, "--one-gpu", "--tp", "2", "--model", "tiny", "--prompts", "4",
         "--max-tokens", "16"]))
    bad = [r for r in doc.get("results", []) if not r.get("exact_vs_transformers", True)]
    if bad or not doc.get("tp1", {}).get("exact_vs_transformers", True):
        doc["failed_checks"] = [f"TP={r['tp']} greedy tokens differ from transformers'"
                                for r in bad] or ["TP=1 differs from transformers"]
    return doc


def step_service(ctx: Ctx) -> dict[str, Any]:
    from engine.loader import load_model_config
    from tools.gpu_check_service import service_step, workload

    vocab = load_model_config(ctx.model_dir).vocab_size
    n, hi, new = (6, 64, 6) if not ctx.cuda else ((24, 512, 48) if ctx.quick else (48, 1024, 96))
    return service_step(ctx.model_dir, ctx.device, ctx.dtype, workload(vocab, n, 16, hi, new))


def device_busy(prof: Any) -> dict[str, Any]:
    """The union of a profiled span's device activity (kernels, copies, memsets, from
    CUPTI) over the span from its first device event's start to its last one's end."""
    from torch.autograd import DeviceType

    spans = sorted((e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == DeviceType.CUDA and e.end_ns() > e.start_ns())
    if not spans:
        return {"device_events": 0}
    busy, (cur_s, cur_e) = 0, spans[0]
    for a, b in spans[1:]:
        if a > cur_e:
            busy, cur_s = busy + cur_e - cur_s, a
        cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    return {"device_events": len(spans), "device_window_s": window / 1e9,
            "device_busy_s": busy / 1e9, "device_busy": busy / window if window else 0.0}


def step_overlap(ctx: Ctx) -> dict[str, Any]:
    """Issue 39 on a GPU: the decode worker's host one step ahead (scheduler.overlap) on
    and off, on one in-process 1P+1D (the decode worker's CUDA-graph step), short
    prompts, 128 output tokens, at 64 and 256 streams: output tok/s (median of the
    unprofiled runs, on and off alternated), the device's busy share from CUPTI (one
    profiled run each: prefill's kernels too, both workers share the GPU), the decode
    worker's steps, on-vs-off greedy equality and a leak check."""
    from torch.profiler import ProfilerActivity, profile

    from engine.loader import load_model_config
    from tools.gpu_check_service import InprocPD, workload

    vocab = load_model_config(ctx.model_dir).vocab_size
    streams = (64,) if ctx.quick else (64, 256)
    reps = 2
    pd = InprocPD(ctx.model_dir, ctx.device, ctx.dtype, max_num_seqs=max(streams))
    out: dict[str, Any] = {"layout": "in-process 1P+1D on one GPU (WorkerLoop threads, tcp "
                           "connector); the decode worker's compiled step",
                           "decode_compile": getattr(getattr(pd.decode.runner, "compiled",
                                                             None), "mode", None)}
    checks: list[str] = []
    try:
        pd.run(workload(vocab, 4, 16, 64, 8))  # warm-up: first steps, allocator, sockets
        for n in streams:
            wl = workload(vocab, n, 16, 64, 128, seed=n)
            row: dict[str, Any] = {}
            tokens: dict[bool, list] = {}
            for i in range(2 * reps + 2):
                on = i % 2 == 0
                pd.set_overlap(on)
                steps0 = pd.stats()[1]
                if i >= 2 * reps:  # the profiled pair
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        r = pd.run(wl)
                    torch.cuda.synchronize()
                    row.setdefault("on" if on else "off", {}).update(device_busy(prof))
                else:
                    r = pd.run(wl)
                d = pd.stats()[1]
                side = row.setdefault("on" if on else "off", {})
                side.setdefault("output_tok_s_runs", []).append(r["output_tok_s"])
                steps = d.num_steps - steps0.num_steps
                side.setdefault("decode_steps_runs", []).append(steps)
                side.setdefault("ms_per_decode_step_runs", []).append(
                    1e3 * r["wall_s"] / max(1, steps))
                side.setdefault("failures", []).extend(r["failures"])
                tokens.setdefault(on, r["tokens"])
                if r["failures"]:
                    checks.append(f"{n} streams, overlap {on}: {len(r['failures'])} legs "
                                  f"failed, first {r['failures'][0]}")
                if any(r["kv_blocks_used_at_end"].values()):
                    checks.append(f"{n} streams, overlap {on}: KV blocks left "
                                  f"{r['kv_blocks_used_at_end']}")
            for side in row.values():
                side["output_tok_s"] = statistics.median(side["output_tok_s_runs"][:reps])
            row["on_over_off_tok_s"] = row["on"]["output_tok_s"] / row["off"]["output_tok_s"]
            same = sum(a == b for a, b in zip(tokens[True], tokens[False], strict=True))
            row["greedy_equal_on_vs_off"] = f"{same}/{n}"
            out[f"streams_{n}"] = row
            print(json.dumps({f"overlap streams_{n}": row}), flush=True)  # kept if cut off
    finally:
        pd.close()
    if checks:
        out["failed_checks"] = checks
    return out


def step_attention_bw(ctx: Ctx) -> dict[str, Any]:
    from tools import attention_bw

    doc = attention_bw.run(["--quick", "--copy-gib", "2"])
    return doc if doc is not None else {"skipped": "attention_bw needs CUDA and Triton"}
