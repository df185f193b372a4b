"""The Triton attention kernels beyond their numerics, on CPU: built for an sm_90 GPU in a
subprocess (lowering errors without a GPU), the per-step ints no compiled launch
specialises on (and the values it would), and the triton backend inside the engine
(registry, greedy output == torch, warmup), under TRITON_INTERPRET=1 as
tests/triton_interp.py sets it. The kernels against the reference: test_triton_attention.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.triton_interp import (
    ATOL,
    RTOL,
    paged_cache,
    prefill_inputs,
    rand,
    torch_ref,
    triton_decode,
    triton_ops,
)

pytestmark = pytest.mark.usefixtures("triton_interpreter")


# ---------------------------------------------------------------------------- engine


def test_registry_resolves_triton_under_interpreter(monkeypatch):
    from engine.attention import get_backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    be = get_backend("triton", "cpu")
    assert be.name == "triton"
    assert be.paged_decode_attention is triton_ops.paged_decode_attention
    assert be.paged_prefill_attention is triton_ops.paged_prefill_attention
    assert be.write_kv is triton_ops.write_kv


def test_engine_greedy_with_triton_backend_equals_torch(tiny_model):
    # the whole engine (write_kv + decode + chunked prefill, as the model calls them)
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2000, (n,), generator=g).tolist() for n in (5, 17, 40)]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model), attention_backend=backend, block_size=8, max_prefill_chunk=13)
        assert llm.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


# ---------------------------------------------------------------------------- sm_90 build

# Compiles the kernels for an H100/H200 (sm_90) in a subprocess, where triton.jit compiles
# instead of interpreting: catches GPU-only lowering errors (layouts, dot shapes, shared
# memory) on a machine without a GPU. Exit 3 = this Triton lacks the API (skip).
_SM90_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)
except Exception as exc:
    print(f"no sm_90 compile API: {exc!r}"); sys.exit(3)
from engine.attention import triton_decode as D, triton_ops as O, triton_prefill as P

DIV16 = ("stride", "partition_size")
def build(name, fn, ptrs, consts, warps, stages):
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            sig[arg] = "constexpr"
            continue
        sig[arg] = ptrs.get(arg, "fp32" if arg == "qk_scale" else "i32")
        runtime = fn.params[i].do_not_specialize  # never specialised by a launch
        if sig[arg].startswith("*") or (arg.startswith(DIV16) and not runtime):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what a real launch specialises on
    try:
        src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    except TypeError as exc:
        print(f"ASTSource API differs: {exc!r}"); sys.exit(3)
    k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    assert k.metadata.shared <= 227 * 1024, (name, k.metadata.shared)
    print(name, "smem", k.metadata.shared)

def io(dt, *extra):
    t = {n: dt for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "k_ptr", "v_ptr")}
    t.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
             part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", slot_ptr="*i64")
    return t

cuda = torch.device("cuda")
for dt, tdt, group, split in [("*bf16", torch.bfloat16, 16, True), ("*fp32", torch.float32, 7, False)]:
    cfg = D.decode_config(tdt, 128, cuda)
    consts = dict(NUM_HEADS=8 * group, GROUP=group, GROUP_PAD=D.next_pow2(group, 16), HEAD_DIM=128,
                  D_PAD=128, BLOCK_SIZE=16, BLOCK_N=cfg["block_n"], SPLIT=split,
                  DOT_PREC=D.dot_precision(tdt))
    build(f"decode {dt} g{group} split={split}", D._decode_kernel, io(dt), consts,
          cfg["num_warps"], cfg["num_stages"])
build("reduce", D._decode_reduce_kernel, io("*bf16"),
      dict(NUM_HEADS=128, HEAD_DIM=128, D_PAD=128, SPLITS_PAD=64), 4, 1)
for dt, tdt, group, d in [("*bf16", torch.bfloat16, 4, 128), ("*fp32", torch.float32, 7, 128)]:
    gp = D.next_pow2(group)
    cfg = P.prefill_config(tdt, d, gp, cuda)
    consts = dict(GROUP=group, GROUP_PAD=gp, HEAD_DIM=d, D_PAD=d, BLOCK_SIZE=16,
                  BLOCK_Q=cfg["block_q"], BLOCK_N=cfg["block_n"], DOT_PREC=D.dot_precision(tdt))
    build(f"prefill {dt} g{group} d{d}", P._prefill_kernel, io(dt), consts,
          cfg["num_warps"], cfg["num_stages"])
build("write_kv", O._write_kv_kernel, io("*bf16"),
      dict(NUM_KV_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, BLOCK_SIZE=16), 4, 1)
"""


def test_kernels_compile_for_sm90():
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's default warning
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, root], env=env, cwd=root,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("smem") == 6, proc.stdout


# ---------------------------------------------------------------------------- recompiles

_NO_SPECIALIZE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from engine.attention import triton_decode as D, triton_prefill as P
for fn, names in [(D._decode_kernel, D.DECODE_RUNTIME_INTS),
                  (D._decode_reduce_kernel, D.REDUCE_RUNTIME_INTS),
                  (P._prefill_kernel, P.PREFILL_RUNTIME_INTS)]:
    flags = {p.name: p.do_not_specialize for p in fn.params}
    assert all(flags[n] for n in names), (fn.fn.__name__, flags)
    print(fn.fn.__name__, sorted(n for n, f in flags.items() if f))
"""


def test_per_step_ints_are_not_specialised_by_compiled_kernels():
    # compiled (not interpreted) kernels, where specialisation happens: a subprocess
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _NO_SPECIALIZE_SCRIPT, root], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "_decode_kernel ['num_splits', 'partition_size', 'stride_bts']" in r.stdout
    assert "_prefill_kernel ['num_seqs', 'stride_bts']" in r.stdout


@pytest.mark.parametrize("num_seqs", [1, 16])
@pytest.mark.parametrize("extra_cols", [0, 15])  # table widths 1/16 and 16/31 blocks
def test_decode_with_values_a_launch_would_specialise_on(num_seqs, extra_cols):
    lens_list = [16 * (1 + (i % 2) * 15) if extra_cols == 0 else 1 + 37 * i
                 for i in range(num_seqs)]
    k_cache, v_cache, table = paged_cache(lens_list, 16, 2, 64, extra_cols=extra_cols,
                                          seed=num_seqs)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    q = rand(num_seqs, 8, 64, seed=3)
    ref = torch_ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    for num_splits in (1, 2, 16):
        out = triton_decode.paged_decode(q, k_cache, v_cache, table, lens, 0.125,
                                         num_splits=num_splits, block_n=16)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("batch", [[(0, 16)], [(16, 16)] * 16, [(0, 1)]], ids=["1seq", "16seq", "1tok"])
def test_prefill_with_values_a_launch_would_specialise_on(batch):
    args = prefill_inputs(batch, 16, 8, 2, 64, seed=len(batch))
    out = triton_ops.paged_prefill_attention(*args, 0.125)
    ref = torch_ref.paged_prefill_attention(*args, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_warmup_runs_every_kernel_variant_and_leaves_the_cache_clear(tiny_model, monkeypatch):
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model), attention_backend="triton", block_size=8, num_blocks=80)
    splits: list[int] = []
    real = triton_decode.paged_decode

    def spy(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw):
        n, _ = triton_decode.plan_splits(
            q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1],
            triton_decode.decode_config(q.dtype, q.shape[2], q.device)["block_n"], q.device)
        splits.append(n)
        return real(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw)

    monkeypatch.setattr(triton_ops, "paged_decode", spy)
    llm.runner.warmup()
    assert 1 in splits and max(splits) > 1  # single-partition and split-K (+ reduce)
    assert llm.runner.kv.data.abs().sum() == 0  # block 0 cleared, nothing else written
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = LLM(str(tiny_model), block_size=8, num_blocks=80)
    prompt = list(range(3, 30))
    assert llm.generate([prompt], params)[0].token_ids == ref.generate([prompt], params)[0].token_ids
