"""Triton paged decode attention: one query token per sequence, split-K over the context.

Grid `(num_seqs, num_kv_heads, num_splits)`. Program `(s, kvh, p)` owns the `GROUP` query
heads `kvh*GROUP .. kvh*GROUP + GROUP - 1` (GQA: K/V tiles are read once for the whole
group) and the context tokens `[p * partition, min((p + 1) * partition, seq_len))`:

    q tile   [GROUP_PAD, D_PAD]   group padded to a power of 2 >= 16 so tl.dot can use MMA
    K/V tile [BLOCK_N, D_PAD]     BLOCK_N logical tokens; token t lives in physical slot
                                  block_tables[s, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    scores   [GROUP_PAD, BLOCK_N] = q @ K^T * scale * log2(e)   (exp2-based online softmax)

With one split the program normalises and writes `out` directly. With several, each
writes its un-normalised accumulator and its running max/sum (fp32) to scratch, and
`_decode_reduce_kernel` (grid `(num_seqs, num_heads)`) merges the partitions:
`out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p` with `M = max_p m_p`.

The launch needs no host sync (CUDA-graph friendly): the number of splits is planned from
`block_tables.shape[1] * block_size` (an upper bound of every seq_len) and the SM count;
programs whose partition starts past their sequence's end exit at once.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # reduce kernel holds [MAX_SPLITS, D] fp32 in registers
MIN_PARTITION = 256  # tokens per split: below this the scratch traffic stops paying off
# Split until the grid holds this many programs per SM. Compiled for sm_90 (Triton 3.9,
# bf16, D=128, BLOCK_N=64) a program uses ~39 KiB smem and 110-150 registers/thread, so
# ~3 are resident per SM; `tools/attention_bw.py --sweep` times the alternatives.
TARGET_PROGRAMS_PER_SM = 4


# ----------------------------------------------------------------------------- shared helpers


def next_pow2(x: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(1, x)))))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32 (the engine's fp32 greedy parity)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; a nominal 4 under the CPU interpreter (so split-K is exercised)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, int, int, int]:
    """Validate shapes; return (num_heads, num_kv_heads, head_dim, block_size)."""
    assert q.dim() == 3 and k_cache.dim() == 4, "q [T, H, D]; cache [blocks, bs, KVH, D]"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    assert q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} KV heads"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.dtype in (torch.int32, torch.int64) and block_tables.stride(1) == 1
    assert q.dtype == k_cache.dtype, f"q {q.dtype} vs cache {k_cache.dtype}"
    return num_heads, num_kv_heads, head_dim, block_size


# ----------------------------------------------------------------------------- kernels

# Integer arguments that change from step to step. Triton specialises an int argument on
# "== 1" and "% 16 == 0" and compiles a variant per combination (~25 per shape, seconds
# each: stalls in the first minutes of serving); these are passed as plain runtime ints.
# Pointers stay specialised on 16-byte alignment: the runner's metadata segments are
# aligned, so each kernel compiles once per constexpr set (see ModelRunner.warmup).
DECODE_RUNTIME_INTS = ("partition_size", "num_splits", "stride_bts")
REDUCE_RUNTIME_INTS = ("partition_size", "num_splits")


@triton.jit(do_not_specialize=DECODE_RUNTIME_INTS)
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, partition_size, num_splits,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    if SPLIT:
        if start >= seq_len:  # this partition is past the sequence's end: reduce skips it
            return
    end = tl.minimum(start + partition_size, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)  # [G] head within the group
    offs_d = tl.arange(0, D_PAD)  # [D]
    offs_n = tl.arange(0, BLOCK_N)  # [N] token within the tile
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # [G] absolute query head

    q_offs = seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G, D]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of 2^(s - m)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)  # running sum of 2^(s - m) * v
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts

    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + offs_n  # [N] logical token index in the sequence
        t_mask = toks < end
        # physical block of every token (a tile may span several pages)
        blk = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        in_blk = toks % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_offs = blk * stride_kb + in_blk * stride_kt + kvh * stride_kh  # [N] int64
        k = tl.load(k_cache_ptr + k_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [G, N] fp32
        s = tl.where(t_mask[None, :], s, float("-inf"))
        # the first tile always holds token `start` < end, so m_new is finite from here on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # [G]; 0 on the first tile (m_i = -inf)
        p = tl.exp2(s - m_new[:, None])  # [G, N]
        l_i = l_i * alpha + tl.sum(p, 1)

        v_offs = blk * stride_vb + in_blk * stride_vt + kvh * stride_vh
        v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if SPLIT:
        # scratch: acc [S, H, num_splits, D_PAD], m/l [S, H, num_splits] (fp32, contiguous)
        row = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits + split  # [G]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc,
                 mask=g_mask[:, None])
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # seq_len == 0 (padding row) -> zeros
        out = acc / l_safe[:, None]
        o_offs = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=REDUCE_RUNTIME_INTS)
def _decode_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr, out_ptr,
    partition_size, num_splits, stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_valid = tl.cdiv(seq_len, partition_size)  # partitions that hold >= 1 token
    offs_p = tl.arange(0, SPLITS_PAD)  # [P]
    offs_d = tl.arange(0, D_PAD)  # [D]
    p_mask = offs_p < n_valid
    row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + offs_p  # [P]
    # a finite sentinel keeps 2^(m - M) free of (-inf) - (-inf) when n_valid == 0
    m = tl.load(part_m_ptr + row, mask=p_mask, other=-1e30)
    lsum = tl.load(part_l_ptr + row, mask=p_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :],
                  mask=p_mask[:, None], other=0.0)  # [P, D]
    w = tl.where(p_mask, tl.exp2(m - tl.max(m, 0)), 0.0)  # [P]
    num = tl.sum(acc * w[:, None], 0)  # [D]
    den = tl.sum(lsum * w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    o_offs = seq.to(tl.int64) * stride_os + head * stride_oh + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# ----------------------------------------------------------------------------- launch


def plan_splits(
    num_seqs: int, num_kv_heads: int, max_ctx: int, block_n: int, device: torch.device,
    target_programs_per_sm: int = TARGET_PROGRAMS_PER_SM, min_partition: int = MIN_PARTITION,
) -> tuple[int, int]:
    """Return (num_splits, partition_size): enough programs to cover the SMs a few times
    over, partitions of at least `min_partition` tokens, a multiple of `block_n`."""
    max_ctx = max(max_ctx, 1)
    base = max(1, num_seqs * num_kv_heads)  # programs without splitting
    want = triton.cdiv(target_programs_per_sm * sm_count(device), base)
    splits = max(1, min(want, triton.cdiv(max_ctx, min_partition), MAX_SPLITS))
    partition = triton.cdiv(triton.cdiv(max_ctx, splits), block_n) * block_n
    return triton.cdiv(max_ctx, partition), partition


def decode_config(dtype: torch.dtype, head_dim: int, device: torch.device) -> dict[str, int]:
    """Tile heuristics: BLOCK_N tokens per iteration, warps, software-pipelining depth."""
    if device.type != "cuda":  # interpreter: big tiles = fewer Python-level iterations
        return {"block_n": 64, "num_warps": 4, "num_stages": 1}
    elem = torch.tensor([], dtype=dtype).element_size()
    # one K + one V tile = 32 KiB; with num_stages=3 Triton loads the block-table entries
    # one iteration ahead and the K/V tiles (cp.async) one tile ahead of the dots
    block_n = max(16, min(128, (16384 // (elem * next_pow2(head_dim)))))
    return {"block_n": block_n, "num_warps": 4, "num_stages": 3 if elem == 2 else 2}


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    target_programs_per_sm: int = TARGET_PROGRAMS_PER_SM,
    min_partition: int = MIN_PARTITION,
) -> torch.Tensor:
    """Decode attention (see module doc); keyword overrides exist for tests and tuning."""
    num_heads, num_kv_heads, head_dim, block_size = check_paged_inputs(
        q, k_cache, v_cache, block_tables
    )
    num_seqs = q.shape[0]
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    cfg = decode_config(q.dtype, head_dim, q.device)
    block_n = block_n or cfg["block_n"]
    max_ctx = block_tables.shape[1] * block_size  # >= every seq_len; no host sync
    if num_splits is None:
        num_splits, partition = plan_splits(
            num_seqs, num_kv_heads, max_ctx, block_n, q.device,
            target_programs_per_sm, min_partition,
        )
    else:
        num_splits = max(1, min(num_splits, MAX_SPLITS))
        partition = triton.cdiv(triton.cdiv(max(max_ctx, 1), num_splits), block_n) * block_n
        num_splits = triton.cdiv(max(max_ctx, 1), partition)
    group = num_heads // num_kv_heads
    d_pad = next_pow2(head_dim, 16)
    split = num_splits > 1
    if split:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, d_pad), dtype=torch.float32,
                               device=q.device)
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused (SPLIT is a constexpr False)
    seq_lens = seq_lens.to(device=q.device, dtype=torch.int32)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_acc, part_m, part_l,
        scale * LOG2E, partition, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=next_pow2(group, 16),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT=split, DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, seq_lens, out,
            partition, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
            SPLITS_PAD=MAX_SPLITS, num_warps=4,  # one variant whatever the split count
        )
    return out
