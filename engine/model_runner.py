"""ScheduledBatch -> input tensors -> forward -> logits of the sampled rows.

The only place that builds tensors. Request-agnostic: a batch is a list of `SeqChunk`s
(tokens to feed, their global start index, the sequence's block table), so colocated
engines, prefill workers and decode workers all drive the same runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import get_backend
from engine.config import EngineConfig
from engine.kv_cache import KVCache, slots_for
from engine.loader import load_model
from engine.models.llama import AttentionMetadata

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class SeqChunk:
    """`token_ids` occupy global positions [start, start + len) of sequence `request_id`."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_ids: tuple[int, ...]
    sample: bool  # compute logits at this chunk's last token

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        self.backend = get_backend(config.attention_backend, self.device)
        self.model = load_model(config.model, config.model_dir, self.device, self.dtype)
        self.model.fuse()  # q/k/v and gate/up as single GEMMs (fewer, larger kernels)
        self.kv = KVCache(config.model, num_blocks, self.block_size, self.dtype, self.device)

    def _table(self, chunks: list[SeqChunk]) -> torch.Tensor:
        width = max((len(c.block_ids) for c in chunks), default=0)
        rows = [list(c.block_ids) + [0] * (width - len(c.block_ids)) for c in chunks]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(chunks), width)

    def _i32(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> tuple[list[str], torch.Tensor]:
        """Run one flat batch; returns (request ids of sampled rows, fp32 logits [N, V])."""
        if not chunks:
            return [], torch.empty(0, self.config.model.vocab_size)
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        prefills = [c for c in chunks if len(c.token_ids) > 1]
        ordered = decodes + prefills  # decode kernel takes the leading single-token rows
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for c in ordered:
            assert c.end <= len(c.block_ids) * self.block_size, f"{c.request_id}: no slot"
            ids.extend(c.token_ids)
            pos.extend(range(c.start, c.end))
            slots.extend(slots_for(c.block_ids, c.start, c.end, self.block_size))
            if c.sample:
                sample_rows.append(len(ids) - 1)
                sample_ids.append(c.request_id)
        q_starts = [0]
        for c in prefills:
            q_starts.append(q_starts[-1] + len(c.token_ids))
        meta = AttentionMetadata(
            backend=self.backend,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decodes),
            decode_block_tables=self._table(decodes),
            decode_seq_lens=self._i32([c.end for c in decodes]),
            prefill_block_tables=self._table(prefills),
            prefill_query_start_loc=self._i32(q_starts),
            prefill_seq_lens=self._i32([c.end for c in prefills]),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(pos, dtype=torch.long, device=self.device),
            self.kv.k, self.kv.v, meta,
        )
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return sample_ids, self.model.compute_logits(hidden.index_select(0, rows))
