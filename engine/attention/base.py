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
