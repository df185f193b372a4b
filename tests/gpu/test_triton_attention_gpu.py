"""Triton paged attention on CUDA == torch reference (fp32 on upcast inputs), fp16/bf16/fp32.

Tolerances (kernel output vs an fp32 reference computed from the same rounded inputs):
fp32 |err| <= 1e-4 + 1e-4 |ref| (ieee dots, no tf32); fp16 3e-3 + 3e-3 |ref| and relative
L2 error < 1e-3; bf16 2e-2 + 2e-2 |ref| and relative L2 error < 8e-3 (P is rounded to the
input dtype before the P @ V product, as in FlashAttention).
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine.attention import torch_ref, triton_decode, triton_ops  # noqa: E402

if isinstance(triton_decode._decode_kernel, InterpretedFunction):
    pytest.skip("triton_ops was imported under TRITON_INTERPRET=1 in this session; "
                "run `pytest tests/gpu` on its own", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
TOL = {torch.float32: (1e-4, None), torch.float16: (3e-3, 1e-3), torch.bfloat16: (2e-2, 8e-3)}
GQA = {"gqa1": (8, 8), "gqa4": (32, 8), "gqa7": (28, 4)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MATRIX = [
    pytest.param(dt, bs, d, *GQA[g], id=f"{dn}-bs{bs}-d{d}-{g}")
    for dn, dt in DTYPES.items()
    for bs in (16, 32)
    for d in (64, 128)
    for g in GQA
]


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol, rel = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    if rel is not None:
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < rel, f"relative L2 error {err:.2e} >= {rel:.0e}"


def paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, extra_cols=0, seed=0):
    """Shuffled block table; never-referenced blocks are NaN, tails/padding finite junk."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device=DEV).to(dtype)
    v_cache = torch.randn(shape, generator=g, device=DEV).to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device=DEV).cpu()
    pad_block = int(perm[-1])
    table = torch.full((len(seq_lens), max(need) + extra_cols), pad_block, dtype=torch.int32)
    referenced = torch.zeros(num_blocks, dtype=torch.bool)
    referenced[pad_block] = True
    start = 0
    for s, nb in enumerate(need):
        table[s, :nb] = perm[start : start + nb]
        referenced[perm[start : start + nb]] = True
        start += nb
    unused = (~referenced).nonzero().flatten().to(DEV)
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    k_cache[pad_block] = 100.0
    v_cache[pad_block] = 100.0
    return k_cache, v_cache, table.to(DEV)


def reference_decode(q, k_cache, v_cache, table, lens, scale):
    return torch_ref.paged_decode_attention(
        q.float(), k_cache.float(), v_cache.float(), table, lens, scale
    )


DECODE_LENS = [1, 15, 16, 17, 300, 1000, 2049, 4100]


@pytest.mark.parametrize(("dtype", "block_size", "head_dim", "num_heads", "num_kv_heads"), MATRIX)
def test_decode_matches_reference(dtype, block_size, head_dim, num_heads, num_kv_heads):
    k_cache, v_cache, table = paged_cache(DECODE_LENS, block_size, num_kv_heads, head_dim, dtype)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEV)
    q = torch.randn(len(DECODE_LENS), num_heads, head_dim, device=DEV).to(dtype)
    scale = head_dim**-0.5
    out = triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    check(out, reference_decode(q, k_cache, v_cache, table, lens, scale), dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_split_k_and_production_shape(num_splits, dtype):
    # 128 query heads over 8 KV heads, dim 128, block 16 (the benchmark's shape)
    lens_list = [8192, 1, 3000, 511]
    k_cache, v_cache, table = paged_cache(lens_list, 16, 8, 128, dtype, extra_cols=3, seed=1)
    lens = torch.tensor(lens_list, dtype=torch.int32, device=DEV)
    q = torch.randn(4, 128, 128, device=DEV).to(dtype)
    out = triton_decode.paged_decode(q, k_cache, v_cache, table, lens, 128**-0.5,
                                     num_splits=num_splits)
    check(out, reference_decode(q, k_cache, v_cache, table, lens, 128**-0.5), dtype)


def test_decode_is_cuda_graph_capturable():
    # no host sync in the launch: capture once, replay with new lens / queries
    lens_list = [100, 2000, 37]
    k_cache, v_cache, table = paged_cache(lens_list, 16, 8, 128, torch.bfloat16, seed=2)
    lens = torch.tensor(lens_list, dtype=torch.int32, device=DEV)
    q = torch.randn(3, 64, 128, device=DEV).bfloat16()
    triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1)
    lens.copy_(torch.tensor([5, 1999, 37], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    check(out, reference_decode(q, k_cache, v_cache, table, lens, 0.1), torch.bfloat16)


PREFILL_BATCH = [(0, 1), (0, 37), (45, 20), (100, 1), (16, 16), (250, 50), (7, 0),
                 (1000, 300), (0, 700), (3000, 129)]


def prefill_inputs(batch, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    seq_lens = [p + c for p, c in batch]
    k_cache, v_cache, table = paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype,
                                          seed=seed)
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([c for _, c in batch]), 0)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, device=DEV).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, table, qsl.to(DEV), lens


@pytest.mark.parametrize(("dtype", "block_size", "head_dim", "num_heads", "num_kv_heads"), MATRIX)
def test_prefill_matches_reference(dtype, block_size, head_dim, num_heads, num_kv_heads):
    args = prefill_inputs(PREFILL_BATCH, block_size, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = triton_ops.paged_prefill_attention(*args, scale)
    q, kc, vc, table, qsl, lens = args
    ref = torch_ref.paged_prefill_attention(q.float(), kc.float(), vc.float(), table, qsl,
                                            lens, scale)
    check(out, ref, dtype)


def test_prefill_fp32_is_ieee_exact_enough():
    args = prefill_inputs(PREFILL_BATCH, 16, 32, 8, 128, torch.float32, seed=3)
    out = triton_ops.paged_prefill_attention(*args, 0.09)
    check(out, torch_ref.paged_prefill_attention(*args, 0.09), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_write_kv_matches_reference(dtype):
    num_blocks, block_size, kvh, d = 64, 16, 8, 128
    k_cache = torch.randn(num_blocks, block_size, kvh, d, device=DEV).to(dtype)
    v_cache = torch.randn_like(k_cache)
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:300]
    slots[::7] = -1
    kv = torch.randn(300, 3 * kvh * d, device=DEV).to(dtype)
    k = kv[:, : kvh * d].view(-1, kvh, d)
    v = kv[:, kvh * d : 2 * kvh * d].view(-1, kvh, d)
    keep = slots >= 0
    torch_ref.write_kv(k[keep], v[keep], exp_k, exp_v, slots[keep])
    triton_ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)
