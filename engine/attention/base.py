"""Attention backend contract: every backend implements these three functions.

Shapes (fixed; the Triton backend implements the same contract):
- caches `[num_blocks, block_size, num_kv_heads, head_dim]`
- `paged_prefill_attention(q [total_q, H, D], k_cache, v_cache, block_tables [S, max_blocks]
  int32, query_start_loc [S+1] int32, seq_lens [S] int32, scale) -> [total_q, H, D]`
- `paged_decode_attention(q [S, H, D], k_cache, v_cache, block_tables, seq_lens, scale)
  -> [S, H, D]`
- `write_kv(k [T, KVH, D], v, k_cache, v_cache, slot_mapping [T]) -> None` (in place)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PrefillFn = Callable[..., torch.Tensor]
DecodeFn = Callable[..., torch.Tensor]
WriteFn = Callable[..., None]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    paged_prefill_attention: PrefillFn
    paged_decode_attention: DecodeFn
    write_kv: WriteFn


@dataclass
class AttentionMetadata:
    """Everything attention needs for one flat batch; built by ModelRunner only."""

    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int  # the first N tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [N, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [N] int32
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [P + 1] int32, relative to the prefill part
    prefill_seq_lens: torch.Tensor  # [P] int32


def attend(
    meta: AttentionMetadata,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V, then attend: the leading `num_decode_tokens` rows are
    single-token decodes, the rest prefill chunks. Returns `[T, H, D]`."""
    be = meta.backend
    be.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    t, n = q.shape[0], meta.num_decode_tokens
    if n == t:
        return be.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                         meta.decode_seq_lens, scale)
    pre = be.paged_prefill_attention(
        q[n:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
        meta.prefill_seq_lens, scale)
    if n == 0:
        return pre
    dec = be.paged_decode_attention(q[:n], k_cache, v_cache, meta.decode_block_tables,
                                    meta.decode_seq_lens, scale)
    return torch.cat((dec, pre))
