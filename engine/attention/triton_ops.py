"""Triton attention backend: the contract of `engine.attention.base`, implemented as GPU
kernels (CUDA; or on CPU under TRITON_INTERPRET=1, which must be set before this module
is imported, since `triton.jit` decides between compiling and interpreting at decoration).

- `paged_prefill_attention`: varlen chunked prefill, one unified kernel (triton_prefill.py)
- `paged_decode_attention`: GQA-grouped split-K decode + reduce (triton_decode.py)
- `write_kv`: scatter of new K/V rows into their cache slots (this file)

Caches are `[num_blocks, block_size, num_kv_heads, head_dim]` with a unit last stride;
other strides are free (a cache may be a view into a larger per-layer tensor). Inputs may
be fp16, bf16 or fp32; softmax and accumulation run in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_decode import next_pow2, paged_decode
from engine.attention.triton_prefill import paged_prefill


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    # one program per token: copy its [KVH, D] K and V rows into slot_mapping[token]
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // BLOCK_SIZE
    in_blk = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [H, D]
    src_k = tok.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = tok.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    dst_k = blk * stride_kcb + in_blk * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = blk * stride_vcb + in_blk * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_cache_ptr + dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter `k`, `v` `[T, KVH, D]` into the caches at `slot_mapping` `[T]` (in place).

    A negative slot (-1) marks a padding token and is skipped. Values are cast to the
    cache dtype.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (k.shape, k_cache.shape)
    assert slot_mapping.shape == (num_tokens,)
    assert k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    slots = slot_mapping.to(device=k.device)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=next_pow2(num_kv_heads),
        D_PAD=next_pow2(head_dim), BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention of each sequence's new queries against its paged context.

    q `[total_q, H, D]`; `query_start_loc` `[num_seqs + 1]`; `seq_lens` `[num_seqs]` is the
    context length *including* this chunk, whose K/V are already in the cache. Query `i`
    of a sequence sits at absolute position `seq_len - q_len + i`. Returns `[total_q, H, D]`.
    """
    return paged_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence (q `[num_seqs, H, D]`) against its whole paged context.

    Launch is sync-free: split-K is planned from `block_tables.shape[1]`, so pad tables
    to the batch's longest sequence rather than to max_model_len for the best grid.
    """
    return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)


__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]
