"""Triton chunked-prefill attention over a paged KV cache (varlen, causal bottom-right).

Each sequence `s` brings `q_len = qsl[s+1] - qsl[s]` new queries whose K/V are already in
the cache; its context is `seq_len = seq_lens[s]` tokens, so query `i` sits at absolute
position `prefix + i` with `prefix = seq_len - q_len` and sees keys `j <= prefix + i`.
Decode rows (`q_len == 1`) are the special case `prefix = seq_len - 1`.

Grid `(total_q // BLOCK_Q + num_seqs, num_kv_heads)` needs no host sync. Sequence `s` owns
the q-tiles `qsl[s] // BLOCK_Q + s .. qsl[s+1] // BLOCK_Q + s` (at least
`cdiv(q_len, BLOCK_Q)` of them); a program finds its sequence by binary search over that
monotone map and exits if its tile starts past `q_len`.

A program's rows pack BLOCK_Q query tokens x GROUP_PAD heads of one KV head (GQA: each
K/V tile is loaded once for the whole group):

    row r  ->  query token q0 + r // GROUP_PAD,  head kvh * GROUP + r % GROUP_PAD
    q tile [BLOCK_M = BLOCK_Q * GROUP_PAD, D_PAD], K/V tiles [BLOCK_N, D_PAD] through the
    block table, scores [BLOCK_M, BLOCK_N], exp2 online softmax in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_decode import LOG2E, check_paged_inputs, dot_precision, next_pow2

PREFILL_RUNTIME_INTS = ("num_seqs", "stride_bts")  # vary per step: see triton_decode


@triton.jit(do_not_specialize=PREFILL_RUNTIME_INTS)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, qk_scale, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)

    # last sequence s with qsl[s] // BLOCK_Q + s <= tile
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first chunk-local query of the tile
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached tokens before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = q0 + offs_m // GROUP_PAD  # [M] chunk-local query index
    g = offs_m % GROUP_PAD  # [M] head within the group
    row_mask = (q_idx < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + g  # [M]
    tok_rows = (q_start + q_idx).to(tl.int64)  # [M] row in the flattened q / out
    q_offs = tok_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [M, D]
    # rows past q_len get pos >= seq_len: they see every loaded key, so no row is all -inf
    pos = prefix + q_idx  # [M] absolute position

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    kv_end = prefix + tl.minimum(q0 + BLOCK_Q, q_len)  # keys past the tile's last query unused

    for tok0 in range(0, kv_end, BLOCK_N):
        toks = tok0 + offs_n  # [N] key position
        t_mask = toks < kv_end
        blk = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        in_blk = toks % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_offs = blk * stride_kb + in_blk * stride_kt + kvh * stride_kh  # [N]
        k = tl.load(k_cache_ptr + k_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N]
        visible = (toks[None, :] <= pos[:, None]) & t_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        # key 0 is visible to every row and sits in the first tile: m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_offs = blk * stride_vb + in_blk * stride_vt + kvh * stride_vh
        v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = tok_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def prefill_config(
    dtype: torch.dtype, head_dim: int, group_pad: int, device: torch.device
) -> dict[str, int]:
    """BLOCK_Q query tokens per program (BLOCK_M = BLOCK_Q * group_pad rows), BLOCK_N keys."""
    elem = torch.tensor([], dtype=dtype).element_size()
    if device.type != "cuda":
        block_m, block_n, warps, stages = 64, 64, 4, 1
    elif elem == 2:  # wgmma tiles; ~180 regs/thread and ~96 KiB smem at head_dim 128
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:  # fp32 "ieee" dots run on FMA units: small tiles, 8 warps (no register spills
        # at head_dim <= 128 when compiled for sm_90; 64x32 with 4 warps spills KiBs)
        block_m, block_n, warps, stages = (64 if head_dim <= 64 else 32), 32, 8, 2
    if head_dim > 128:
        block_m, block_n = max(16, block_m // 2), max(16, block_n // 2)
    block_q = max(1, block_m // group_pad)
    return {"block_q": block_q, "block_n": block_n, "num_warps": warps, "num_stages": stages}


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    block_q: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Varlen causal prefill attention (see module doc); overrides exist for tests/tuning."""
    num_heads, num_kv_heads, head_dim, block_size = check_paged_inputs(
        q, k_cache, v_cache, block_tables
    )
    total_q = q.shape[0]
    num_seqs = seq_lens.shape[0]
    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total_q == 0 or num_seqs == 0:
        return out
    assert query_start_loc.shape[0] == num_seqs + 1
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    cfg = prefill_config(q.dtype, head_dim, group_pad, q.device)
    block_q = block_q or cfg["block_q"]
    block_n = block_n or cfg["block_n"]
    assert block_q * group_pad >= 16 and block_n >= 16, "tl.dot needs tiles >= 16"
    qsl = query_start_loc.to(device=q.device, dtype=torch.int32)
    lens = seq_lens.to(device=q.device, dtype=torch.int32)
    grid = (total_q // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, qsl, lens,
        out, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim, 16),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
