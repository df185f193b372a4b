"""Triton paged-attention kernels == torch reference, on CPU under TRITON_INTERPRET=1
(tests/triton_interp.py imports them so; the tolerance is there): decode (split-K
partitions, padding rows, strided and fp16 queries), prefill (chunks, tile shapes, mixed
batches) and write_kv. Compiled builds and the engine: test_triton_compile.py.
"""

from __future__ import annotations

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
    triton_prefill,
)

pytestmark = pytest.mark.usefixtures("triton_interpreter")

GQA = {"gqa1": (2, 2), "gqa4": (8, 2), "gqa7": (14, 2)}  # (query heads, kv heads)
MATRIX = [
    pytest.param(bs, d, *GQA[g], id=f"bs{bs}-d{d}-{g}")
    for bs in (16, 32)
    for d in (64, 128)
    for g in GQA
]


# ---------------------------------------------------------------------------- decode

DECODE_LENS = [1, 15, 16, 17, 100, 300]  # one token, block edges, several hundred


@pytest.mark.parametrize(("block_size", "head_dim", "num_heads", "num_kv_heads"), MATRIX)
def test_decode_matches_reference(block_size, head_dim, num_heads, num_kv_heads):
    k_cache, v_cache, table = paged_cache(DECODE_LENS, block_size, num_kv_heads, head_dim)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    q = rand(len(DECODE_LENS), num_heads, head_dim)
    scale = head_dim**-0.5
    out = triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    ref = torch_ref.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("num_splits", "block_n"), [(1, 64), (3, 16), (7, 32), (64, 16)], ids=lambda x: str(x)
)
def test_decode_split_k_partitions(num_splits, block_n):
    # block_size 32 with 16-token tiles: partition edges fall inside pages; 64 splits
    # leave most partitions past the shorter sequences' ends (those programs exit)
    lens_list = [5, 33, 250, 161]
    k_cache, v_cache, table = paged_cache(lens_list, 32, 2, 64, extra_cols=2, seed=3)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    q = rand(len(lens_list), 8, 64, seed=4)
    out = triton_decode.paged_decode(
        q, k_cache, v_cache, table, lens, 0.125, num_splits=num_splits, block_n=block_n
    )
    ref = torch_ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_zero_length_padding_row_gives_zeros(num_splits):
    lens_list = [40, 0, 7]
    k_cache, v_cache, table = paged_cache(lens_list, 16, 1, 64, seed=5)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    q = rand(3, 4, 64, seed=6)
    out = triton_decode.paged_decode(q, k_cache, v_cache, table, lens, 0.1,
                                     num_splits=num_splits, block_n=16)
    ref = torch_ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], atol=ATOL, rtol=RTOL)


def test_decode_strided_q_and_fp16():
    # q as a view into a fused qkv buffer (row stride != H*D); fp16 end to end
    lens_list = [3, 64, 129]
    k_cache, v_cache, table = paged_cache(lens_list, 16, 2, 64, dtype=torch.float16, seed=7)
    qkv = rand(3, (8 + 2 * 2) * 64, seed=8).half()
    q = qkv[:, : 8 * 64].view(3, 8, 64)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    out = triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    ref = torch_ref.paged_decode_attention(
        q.float(), k_cache.float(), v_cache.float(), table, lens, 0.125
    )
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------- prefill

# (cached prefix, chunk length) per sequence: a 1-token prompt, a whole prompt, a chunk
# starting and ending inside blocks, a decode row (q_len 1), a block-aligned chunk, a
# long chunk after a long prefix, and an idle sequence (q_len 0)
PREFILL_BATCH = [(0, 1), (0, 37), (45, 20), (100, 1), (16, 16), (250, 50), (7, 0)]


@pytest.mark.parametrize(("block_size", "head_dim", "num_heads", "num_kv_heads"), MATRIX)
def test_prefill_matches_reference(block_size, head_dim, num_heads, num_kv_heads):
    args = prefill_inputs(PREFILL_BATCH, block_size, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = triton_ops.paged_prefill_attention(*args, scale)
    ref = torch_ref.paged_prefill_attention(*args, scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_prefill_in_chunks_equals_one_shot():
    # one 150-token prompt run as chunks 37 | 63 | 50 (edges inside 16-token blocks)
    # must give the same rows as the whole prompt at once: causal alignment by position
    q, k_cache, v_cache, table, _, _ = prefill_inputs([(0, 150)], 16, 8, 2, 64, seed=9)
    whole = triton_ops.paged_prefill_attention(
        q, k_cache, v_cache, table, torch.tensor([0, 150], dtype=torch.int32),
        torch.tensor([150], dtype=torch.int32), 0.125,
    )
    parts = []
    for a, b in [(0, 37), (37, 100), (100, 150)]:
        parts.append(triton_ops.paged_prefill_attention(
            q[a:b], k_cache, v_cache, table, torch.tensor([0, b - a], dtype=torch.int32),
            torch.tensor([b], dtype=torch.int32), 0.125,
        ))
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=RTOL)


def test_prefill_of_single_tokens_equals_decode():
    batch = [(0, 1), (31, 1), (64, 1), (200, 1)]
    q, k_cache, v_cache, table, qsl, lens = prefill_inputs(batch, 32, 14, 2, 64, seed=10)
    pre = triton_ops.paged_prefill_attention(q, k_cache, v_cache, table, qsl, lens, 0.125)
    dec = triton_ops.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(pre, dec, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_q"),
    [(16, 1, 1), (16, 2, 2), (2, 2, 16), (4, 4, 32)],
    ids=["g16-bq1", "g8-bq2", "g1-bq16", "g1-bq32"],
)
def test_prefill_tile_shapes(num_heads, num_kv_heads, block_q):
    # many q-tiles per sequence (tile -> sequence binary search), BLOCK_M = 16 or 32
    batch = [(5, 3), (0, 20), (33, 9), (0, 2), (9, 0), (40, 12)]
    args = prefill_inputs(batch, 16, num_heads, num_kv_heads, 64, seed=11)
    out = triton_prefill.paged_prefill(*args, 0.1, block_q=block_q, block_n=16)
    ref = torch_ref.paged_prefill_attention(*args, 0.1)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("seed", "block_size", "gqa"), [(0, 1, "gqa4"), (1, 8, "gqa7"), (2, 32, "gqa1")],
    ids=["bs1-gqa4", "bs8-gqa7", "bs32-gqa1"],
)
def test_random_mixed_batches(seed, block_size, gqa):
    # random prefixes and chunk lengths; block sizes 1 and 8 are what the engine tests use
    g = torch.Generator().manual_seed(100 + seed)
    num_heads, num_kv_heads = GQA[gqa]
    n_seqs = int(torch.randint(2, 6, (1,), generator=g))
    prefixes = torch.randint(0, 200, (n_seqs,), generator=g).tolist()
    chunks = torch.randint(1, 60, (n_seqs,), generator=g).tolist()
    batch = list(zip(prefixes, chunks, strict=True))
    args = prefill_inputs(batch, block_size, num_heads, num_kv_heads, 64, seed=seed)
    out = triton_ops.paged_prefill_attention(*args, 0.125)
    ref = torch_ref.paged_prefill_attention(*args, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    # the same caches as a decode batch: one query per sequence at its last position
    q, k_cache, v_cache, table, _, lens = args
    q1 = rand(len(batch), num_heads, 64, seed=seed + 50)
    out = triton_ops.paged_decode_attention(q1, k_cache, v_cache, table, lens, 0.125)
    ref = torch_ref.paged_decode_attention(q1, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
def test_write_kv_scatters_and_skips_padding(cache_dtype):
    num_blocks, block_size, kvh, d = 6, 16, 2, 64
    k_cache = rand(num_blocks, block_size, kvh, d, seed=12).to(cache_dtype)
    v_cache = rand(num_blocks, block_size, kvh, d, seed=13).to(cache_dtype)
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, 3, -1, 95, 40, -1, 64], dtype=torch.int64)
    kv = rand(len(slots), 3 * kvh * d, seed=14)  # fused buffer: strided k / v views
    k = kv[:, : kvh * d].view(-1, kvh, d)
    v = kv[:, kvh * d : 2 * kvh * d].view(-1, kvh, d)
    keep = slots >= 0
    torch_ref.write_kv(k[keep], v[keep], exp_k, exp_v, slots[keep])
    triton_ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)
