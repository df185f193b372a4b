"""Reference paged attention in plain torch (any device).

Caches are `[num_blocks, block_size, num_kv_heads, head_dim]`. Sequence `s` owns the
physical blocks `block_tables[s, : ceil(seq_lens[s] / block_size)]`; its token `i`
lives in slot `block_tables[s, i // block_size] * block_size + i % block_size`.

A step calls these once per layer with the same metadata tensors (ModelRunner builds them
once per step), so what depends on the metadata alone (lengths read on the host, gather
indices, masks) is worked out at the first layer and reused by the others (`_per_step`):
a decode step of 30 thin layers pays for it once, not 30 times.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F

_T = TypeVar("_T")
_memo = threading.local()  # per thread: engines on other threads keep their own entries


def _per_step(kind: str, keys: tuple[torch.Tensor | None, ...], build: Callable[[], _T]
              ) -> _T:
    """`build()`, or what it returned for these very tensor objects `keys` (the last call
    of this `kind` on this thread). The entry holds the tensors, so an id is never reused
    while it is compared; a step's metadata tensors are new objects every step."""
    hit = _memo.__dict__.get(kind)
    if hit is not None and len(hit[0]) == len(keys) and all(
            x is y for x, y in zip(hit[0], keys, strict=True)):
        return hit[1]
    value = build()
    _memo.__dict__[kind] = (keys, value)
    return value


def _attend_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """q `[n, q_len, H, D]` at the last q_len positions of k/v `[n, kv_len, KVH, D]`
    (bottom-right causal; `mask` `[q_len, kv_len]` when 1 < q_len < kv_len) -> `[n, q_len,
    H, D]`.

    Computed in fp32 by `F.scaled_dot_product_attention` (one fused kernel; a square chunk
    uses `is_causal`, so the masked half is never computed). Query head `h` reads KV head
    `h // (H // KVH)`, as in HF's `repeat_kv`.
    """
    q_len, num_heads = q.shape[1], q.shape[2]
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    out = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=mask, is_causal=q_len > 1 and q_len == kv_len, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [n, H, q, d] (the transposes are views, no copies)
    return out.transpose(1, 2).to(q.dtype)


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
    of a sequence sits at absolute position `seq_len - q_len + i`.

    Sequences of the same (chunk, context) lengths -- a burst of equal prompts, the
    chunks of long prompts at the same offset -- share one gather and one kernel call (a
    batch of them), so a step of many short prompts is not one Python round per prompt
    per layer. Each sequence's rows are computed as alone (the kernel splits work per
    batch row and head, never across them).
    """
    out = torch.empty_like(q)
    groups = _per_step("prefill", (query_start_loc, seq_lens, block_tables),
                       lambda: _prefill_plan(block_tables, query_start_loc, seq_lens,
                                             k_cache.shape[1]))
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    for g in groups:
        n = len(g.seqs)
        if g.rows is None:  # one sequence: its rows are a slice
            qg = q[g.start:g.start + g.q_len].unsqueeze(0)
        else:
            qg = q.index_select(0, g.rows).view(n, g.q_len, num_heads, head_dim)
        k = k_cache.index_select(0, g.blocks).view(n, -1, num_kv_heads, head_dim)
        v = v_cache.index_select(0, g.blocks).view(n, -1, num_kv_heads, head_dim)
        res = _attend_batch(qg, k[:, :g.kv_len], v[:, :g.kv_len], scale, g.mask)
        if g.rows is None:
            out[g.start:g.start + g.q_len] = res[0]
        else:
            out.index_copy_(0, g.rows, res.reshape(n * g.q_len, num_heads, head_dim))
    return out


class _Group:
    """Prefill sequences of one (q_len, kv_len): their query rows (None for a single
    sequence: rows [start, start + q_len)), block gather index and mask."""

    __slots__ = ("seqs", "q_len", "kv_len", "start", "rows", "blocks", "mask")

    def __init__(self, q_len: int, kv_len: int):
        self.seqs: list[int] = []
        self.q_len, self.kv_len = q_len, kv_len
        self.start = 0
        self.rows = self.blocks = self.mask = None


def _prefill_plan(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_size: int) -> list[_Group]:
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    by_shape: dict[tuple[int, int], _Group] = {}
    for s, kv_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len == 0:
            continue
        g = by_shape.get((q_len, kv_len))
        if g is None:
            g = by_shape[(q_len, kv_len)] = _Group(q_len, kv_len)
        g.seqs.append(s)
    dev = block_tables.device
    for g in by_shape.values():
        n_blocks = (g.kv_len + block_size - 1) // block_size
        g.start = starts[g.seqs[0]]
        if len(g.seqs) == 1:
            tables = block_tables[g.seqs[0]:g.seqs[0] + 1, :n_blocks]
        else:
            tables = block_tables.index_select(0, torch.tensor(g.seqs, device=dev))[:, :n_blocks]
        g.blocks = tables.reshape(-1).long()
        if len(g.seqs) > 1:
            first = torch.tensor([starts[s] for s in g.seqs], device=dev)
            g.rows = (first.unsqueeze(1) + torch.arange(g.q_len, device=dev)).reshape(-1)
        if 1 < g.q_len < g.kv_len:
            # query i sits at absolute position kv_len - q_len + i and sees keys j <= that
            q_pos = torch.arange(g.kv_len - g.q_len, g.kv_len, device=dev).unsqueeze(1)
            g.mask = torch.arange(g.kv_len, device=dev).unsqueeze(0) <= q_pos  # [q, kv]
    return list(by_shape.values())


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence (q `[num_seqs, H, D]`) against its whole paged context.

    Batched: gathers every sequence's blocks into a padded `[S, max_blocks*bs, KVH, D]`
    tensor and masks the padding, so a decode step costs one kernel chain, not one per seq.
    The `H // KVH` query heads sharing a KV head ride as that head's rows of queries,
    so K/V are never repeated per query head.
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    idx, width, keys, mask = _per_step("decode", (block_tables, seq_lens),
                                       lambda: _decode_plan(block_tables, seq_lens, block_size))
    # [S, kvh, T, d] strided views of the gathered blocks (one copy: the gather)
    k = k_cache.index_select(0, idx).view(num_seqs, width, num_kv_heads, head_dim)
    v = v_cache.index_select(0, idx).view(num_seqs, width, num_kv_heads, head_dim)
    k, v = k[:, :keys].transpose(1, 2), v[:, :keys].transpose(1, 2)
    qh = q.reshape(num_seqs, num_kv_heads, group, head_dim)  # [S, kvh, g, d]
    if q.dtype != torch.float32:  # computed in fp32
        qh, k, v = qh.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)  # [S, kvh, g, d]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
                 ) -> tuple[torch.Tensor, int, int, torch.Tensor | None]:
    """(block gather index, gathered width, keys attended, mask `[S, 1, 1, keys]` or None):
    one sequence attends to exactly its `seq_len` keys, several to the longest, masked."""
    max_len = int(seq_lens.max())
    n_blocks = (max_len + block_size - 1) // block_size
    idx = block_tables[:, :n_blocks].reshape(-1).long()
    if seq_lens.shape[0] == 1:
        return idx, n_blocks * block_size, max_len, None
    pos = torch.arange(max_len, device=block_tables.device)
    valid = pos.unsqueeze(0) < seq_lens.to(block_tables.device).unsqueeze(1)  # [S, T]
    return idx, n_blocks * block_size, max_len, valid[:, None, None, :]


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V `[tokens, KVH, D]` into their slots (`slot_mapping` `[tokens]`).

    A negative slot (-1) marks a padding token and is skipped (padding rows trail)."""
    flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    idx, n = _per_step("write", (slot_mapping,), lambda: _write_plan(slot_mapping))
    if n < k.shape[0]:
        k, v = k[:n], v[:n]
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    flat_k.index_copy_(0, idx, k)
    flat_v.index_copy_(0, idx, v)


def _write_plan(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(int64 slots of the real tokens, their count): padding slots (-1) trail."""
    idx = slot_mapping.long()
    if idx.numel() and idx[-1] < 0:
        n = int((idx >= 0).sum())
        return idx[:n], n
    return idx, idx.numel()
