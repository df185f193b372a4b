"""Reference paged attention in plain torch (any device).

Caches are `[num_blocks, block_size, num_kv_heads, head_dim]`. Sequence `s` owns the
physical blocks `block_tables[s, : ceil(seq_lens[s] / block_size)]`; its token `i`
lives in slot `block_tables[s, i // block_size] * block_size + i % block_size`.
"""

from __future__ import annotations

import torch


def _gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:n_blocks].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]  # [seq_len, kvh, d]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [q_len, H, D] at the last q_len positions of k/v [kv_len, KVH, D] (bottom-right causal)."""
    q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qh = q.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, g, q, d]
    kh = k.permute(1, 0, 2).unsqueeze(1)  # [kvh, 1, kv, d]
    vh = v.permute(1, 0, 2).unsqueeze(1)
    scores = torch.matmul(qh.float(), kh.float().transpose(-1, -2)) * scale  # [kvh, g, q, kv]
    if q_len > 1:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(kv_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vh.float())  # [kvh, g, q, d]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(q.dtype)


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
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        k = _gather_kv(k_cache, block_tables[s], seq_len)
        v = _gather_kv(v_cache, block_tables[s], seq_len)
        out[a:b] = _attend(q[a:b], k, v, scale)
    return out


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
    view and masks the padding, so a decode step costs one kernel chain, not one per seq.
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    n_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :n_blocks].long()
    k = k_cache[table].reshape(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[table].reshape(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)
    qh = q.reshape(num_seqs, num_kv_heads, group, head_dim).float()  # [S, kvh, g, d]
    scores = torch.einsum("skgd,stkd->skgt", qh, k.float()) * scale  # [S, kvh, g, T]
    pos = torch.arange(n_blocks * block_size, device=q.device)
    pad = pos.unsqueeze(0) >= seq_lens.to(q.device).unsqueeze(1)  # [S, T]
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgt,stkd->skgd", probs, v.float())
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V `[tokens, KVH, D]` into their slots (`slot_mapping` `[tokens]`)."""
    flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    idx = slot_mapping.long()
    flat_k.index_copy_(0, idx, k.to(k_cache.dtype))
    flat_v.index_copy_(0, idx, v.to(v_cache.dtype))
