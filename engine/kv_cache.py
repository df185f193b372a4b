"""Paged KV tensors, slot arithmetic, and export/import of token ranges for kv_transfer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import ModelConfig


def slots_for(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of global token indices [start, end): `block[i // bs] * bs + i % bs`."""
    return [block_ids[i // block_size] * block_size + i % block_size for i in range(start, end)]


class KVCache:
    """Per layer K and V caches, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.num_layers = model.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem

    def _slot_index(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        slots = slots_for(block_ids, start, end, self.block_size)
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def export_tokens(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """KV of tokens [start, end) as one contiguous CPU tensor `[L, 2, T, KVH, D]`."""
        idx = self._slot_index(block_ids, start, end)
        out = torch.empty(
            (self.num_layers, 2, end - start) + tuple(self.k[0].shape[2:]), dtype=self.dtype
        )
        for layer in range(self.num_layers):
            flat_k = self.k[layer].view(-1, *self.k[layer].shape[2:])
            flat_v = self.v[layer].view(-1, *self.v[layer].shape[2:])
            out[layer, 0] = flat_k.index_select(0, idx).cpu()
            out[layer, 1] = flat_v.index_select(0, idx).cpu()
        return out

    def import_tokens(
        self, block_ids: Sequence[int], start: int, data: torch.Tensor, layer_start: int = 0
    ) -> None:
        """Write `data` `[L', 2, T, KVH, D]` as the KV of global tokens [start, start + T)
        for layers [layer_start, layer_start + L')."""
        num_tokens = data.shape[2]
        assert data.shape[1] == 2 and layer_start + data.shape[0] <= self.num_layers, data.shape
        idx = self._slot_index(block_ids, start, start + num_tokens)
        data = data.to(device=self.device, dtype=self.dtype)
        for i in range(data.shape[0]):
            layer = layer_start + i
            self.k[layer].view(-1, *self.k[layer].shape[2:]).index_copy_(0, idx, data[i, 0])
            self.v[layer].view(-1, *self.v[layer].shape[2:]).index_copy_(0, idx, data[i, 1])
