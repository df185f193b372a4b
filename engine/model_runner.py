"""ScheduledBatch -> input tensors -> forward -> logits of the sampled rows.

The only place that builds tensors. Request-agnostic: a batch is a list of `SeqChunk`s
(tokens to feed, their global start index, the sequence's block table), so colocated
engines, prefill workers and decode workers all drive the same runner.

Per step, every integer the forward needs (token ids, positions, slots, block tables,
sequence lengths, query starts, sampled rows) is packed into one int32 host buffer and
reaches the device in one copy (non-blocking from pinned memory on CUDA); the tensors
the model sees are views of it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from engine.attention import get_backend
from engine.config import EngineConfig, torch_dtype
from engine.device import ThreadBinder, pinned_empty
from engine.kv_cache import KVCache, slots_for
from engine.loader import load_model
from engine.memory import check_kv_fits, device_memory, num_kv_blocks
from engine.models.llama import AttentionMetadata

__all__ = ["ModelRunner", "SeqChunk", "StepLogits", "torch_dtype"]
_ALIGN = 4  # int32s: every segment starts 16-byte aligned (Triton specialises on that)


@dataclass(frozen=True)
class SeqChunk:
    """`token_ids` occupy global positions [start, start + len) of sequence `request_id`."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_ids: tuple[int, ...]
    sample: bool  # compute logits at this chunk's last token
    all_logits: bool = False  # also the logits at every one of its tokens (prompt log-probs)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class StepLogits:
    """What one step computed: fp32 logits of the sampled rows `[N, V]` (`sample_ids[i]`
    is row i's request) and, for each chunk with `all_logits`, the logits at each of its
    tokens `[len(chunk), V]`, by request id."""

    sample_ids: list[str]
    logits: torch.Tensor
    all_logits: dict[str, torch.Tensor]


class _StepBuffer:
    """One int32 host buffer per step, one copy to the device. On CUDA the host side is
    pinned and reused: before it is rewritten, the previous step's copy out of it must
    have finished (an event, normally long done)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.values = array("i")
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def add(self, values) -> tuple[int, int]:
        """Append a segment; returns its (offset, length)."""
        pad = -len(self.values) % _ALIGN
        self.values.extend([0] * pad)
        off = len(self.values)
        self.values.extend(values)
        return off, len(self.values) - off

    def upload(self) -> torch.Tensor:
        n = len(self.values)
        src = torch.frombuffer(self.values, dtype=torch.int32) if n else torch.empty(0, dtype=torch.int32)
        self.values = array("i")
        if not self.cuda:
            return src
        if self._host is None or self._host.numel() < n:
            cap = max(1024, 1 << (n - 1).bit_length())
            self._host = pinned_empty((cap,), torch.int32)
            self._dev = torch.empty(cap, dtype=torch.int32, device=self.device)
        elif self._copied is not None:
            self._copied.synchronize()
        self._host[:n].copy_(src)
        self._dev[:n].copy_(self._host[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self._dev


class ModelRunner:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None):
        """`num_blocks=None`: size the KV cache once the weights are loaded (on a GPU,
        from the memory they leave; see engine.memory)."""
        self.config = config
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.bind = ThreadBinder(device)
        self.bind()
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        self.backend = get_backend(config.attention_backend, self.device)
        self.model = load_model(config.model, config.model_dir, self.device, self.dtype)
        self.model.fuse()  # q/k/v and gate/up as single GEMMs (fewer, larger kernels)
        memory = device_memory(self.device) if self.device.type == "cuda" else None
        if num_blocks is None:
            num_blocks = num_kv_blocks(config, memory=memory)
        elif memory is not None:
            check_kv_fits(config, num_blocks, free=memory[0])
        self.num_blocks = num_blocks
        self.kv = KVCache(config.model, num_blocks, self.block_size, self.dtype, self.device)
        self._buf = _StepBuffer(self.device)
        if self.backend.name == "triton" and self.device.type == "cuda":
            self.warmup()

    def _table(self, chunks: list[SeqChunk]) -> tuple[int, int, int]:
        """Block tables of `chunks` padded with block 0: (offset, rows, width)."""
        width = max((len(c.block_ids) for c in chunks), default=0)
        flat: list[int] = []
        for c in chunks:
            flat.extend(c.block_ids)
            flat.extend([0] * (width - len(c.block_ids)))
        off, _ = self._buf.add(flat)
        return off, len(chunks), width

    def execute(self, chunks: list[SeqChunk]) -> tuple[list[str], torch.Tensor]:
        """Run one flat batch; returns (request ids of sampled rows, fp32 logits [N, V])."""
        step = self.run(chunks)
        return step.sample_ids, step.logits

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk]) -> StepLogits:
        """Run one flat batch: the sampled rows' logits, and every token's of the chunks
        that ask for them (`SeqChunk.all_logits`), from one lm_head pass."""
        if not chunks:
            return StepLogits([], torch.empty(0, self.config.model.vocab_size), {})
        self.bind()
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        prefills = [c for c in chunks if len(c.token_ids) > 1]
        ordered = decodes + prefills  # decode kernel takes the leading single-token rows
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        full_rows: list[int] = []  # rows after the sampled ones: all_logits chunks' tokens
        full_ids: list[tuple[str, int]] = []
        for c in ordered:
            assert c.end <= len(c.block_ids) * self.block_size, f"{c.request_id}: no slot"
            ids.extend(c.token_ids)
            pos.extend(range(c.start, c.end))
            slots.extend(slots_for(c.block_ids, c.start, c.end, self.block_size))
            if c.sample:
                sample_rows.append(len(ids) - 1)
                sample_ids.append(c.request_id)
            if c.all_logits:
                full_rows.extend(range(len(ids) - len(c.token_ids), len(ids)))
                full_ids.append((c.request_id, len(c.token_ids)))
        q_starts = [0]
        for c in prefills:
            q_starts.append(q_starts[-1] + len(c.token_ids))
        b = self._buf
        seg = {"ids": b.add(ids), "pos": b.add(pos), "slots": b.add(slots),
               "rows": b.add(sample_rows + full_rows), "dlens": b.add([c.end for c in decodes]),
               "qsl": b.add(q_starts), "plens": b.add([c.end for c in prefills])}
        dtab, ptab = self._table(decodes), self._table(prefills)
        dev = b.upload()

        def view(name: str) -> torch.Tensor:
            off, n = seg[name]
            return dev[off:off + n]

        def table(t: tuple[int, int, int]) -> torch.Tensor:
            off, rows, width = t
            return dev[off:off + rows * width].view(rows, width)

        # decode side: the GPU waits for KV still arriving into blocks this step reads
        self.kv.wait_imports(b for c in ordered for b in c.block_ids)
        meta = AttentionMetadata(
            backend=self.backend,
            slot_mapping=view("slots"),
            num_decode_tokens=len(decodes),
            decode_block_tables=table(dtab),
            decode_seq_lens=view("dlens"),
            prefill_block_tables=table(ptab),
            prefill_query_start_loc=view("qsl"),
            prefill_seq_lens=view("plens"),
        )
        hidden = self.model(view("ids"), view("pos"), self.kv.k, self.kv.v, meta)
        logits = self.model.compute_logits(hidden.index_select(0, view("rows")))
        if not full_ids:
            return StepLogits(sample_ids, logits, {})
        full, at = {}, len(sample_rows)
        for rid, n in full_ids:
            full[rid] = logits[at:at + n]
            at += n
        return StepLogits(sample_ids, logits[:len(sample_rows)], full)

    def warmup(self) -> None:
        """Compile every attention kernel variant serving will launch (prefill, write_kv,
        decode with and without split-K and its reduce) on block 0, then clear block 0:
        the first requests do not wait for the compiler."""
        long = (0,) * (2 * 512 // self.block_size + 1)  # > 2 split-K partitions of context
        warm = [
            [SeqChunk("warm-p", (1, 2), 0, (0,), sample=True)],
            [SeqChunk("warm-d", (1,), 1, (0,), sample=True),
             SeqChunk("warm-p", (1, 2), 0, (0,), sample=False)],
            [SeqChunk("warm-s", (1,), len(long) * self.block_size - 1, long, sample=True)],
        ]
        for batch in warm:
            self.execute(batch)
        self.kv.data[:, :, 0].zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
