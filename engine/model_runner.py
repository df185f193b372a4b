"""ScheduledBatch -> input tensors -> forward -> logits of the sampled rows.

The only place that builds tensors. Request-agnostic: a batch is a list of `SeqChunk`s
(tokens to feed, their global start index, the sequence's block table), so colocated
engines, prefill workers and decode workers all drive the same runner.

Per step, every integer the forward needs (token ids, positions, slots, block tables,
sequence lengths, query starts, sampled rows) is packed into one int32 host buffer and
reaches the device in one copy (non-blocking from pinned memory on CUDA); the tensors
the model sees are views of it. The forward is the compiled one where engine.compile
says so (a CUDA-graph decode step reads the buffer at offsets fixed by its bucket).
"""

from __future__ import annotations

import functools
import logging
import threading
from array import array
from dataclasses import dataclass

import torch

from engine.attention import get_backend
from engine.attention.base import AttentionMetadata
from engine.compile import CompiledStep, runner_mode
from engine.compile_ops import step_context
from engine.config import EngineConfig, torch_dtype
from engine.device import ThreadBinder, pinned_empty
from engine.kv_cache import KVCache, slots_for
from engine.loader import load_model
from engine.memory import check_kv_fits, device_memory, num_kv_blocks
from engine.models.linear import can_pack, drop_onednn
from engine.parallel.loader import load_shard
from engine.parallel.state import rank_shard
from engine.runner_warmup import run_padding, warm_kernels, warms_kernels

__all__ = ["ModelRunner", "SeqChunk", "StepLogits", "torch_dtype"]
log = logging.getLogger(__name__)
_ALIGN = 4  # int32s: every segment starts 16-byte aligned (Triton specialises on that)


def _no_binding() -> None:
    """A CPU runner's `bind`: no thread has a device to bind."""


@dataclass(slots=True)  # one per scheduled request per step: not frozen, whose __init__
class SeqChunk:  # costs ~0.7 us of each decode token (a plain one ~0.17 us)
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

    def __init__(self, device: torch.device, capacity: int = 0):
        """`capacity` > 0: allocate once, never move (CUDA graphs read it in place)."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.values = array("i")
        self.fixed = capacity > 0
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if self.fixed and self.cuda:
            self._host = pinned_empty((capacity,), torch.int32)
            self._dev = torch.zeros(capacity, dtype=torch.int32, device=device)

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
            assert not self.fixed, f"step buffer of {self._host.numel()} int32s, {n} needed"
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


class _GraphTables:
    """The decode block tables that padded (CUDA-graph) steps read: one int32 tensor
    `[largest bucket, width]` on the device, never moved (a bucket's graph reads its first
    `bucket` rows in place). Each step writes only what changed since the previous one:

    - rows: a request keeps its row from step to step (`place`); one that leaves frees
      its row, and a request from a row past the batch's end moves into the hole (one
      row rewritten, not every row after the leaver shifted up);
    - entries: per row it remembers the table it holds; a row whose table grew gets its
      new entries, one whose table changed otherwise its whole table. Comparing costs a
      pointer per block in use; writing, the new blocks.

    The changes, as (flat index, block id) pairs, reach the device in one copy and one
    scatter. Entries past a row's length are stale block ids of this cache (the kernels
    read a row only up to its sequence length), never out of range."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.width = width
        self.table = torch.zeros((rows, width), dtype=torch.int32, device=device)  # [R, W]
        self._flat = self.table.view(-1)
        self._held: list[tuple[int, ...]] = [()] * rows
        self._row: dict[str, int] = {}  # request id -> its row
        self._buf = _StepBuffer(device)  # the changes' own upload (its size varies)
        self.written = 0  # entries uploaded so far (what a test can count)

    def place(self, decodes: list[SeqChunk]) -> list[SeqChunk]:
        """`decodes` in the order of their rows: rows 0..n-1, each request in the row it
        had at the last padded step where it could keep it."""
        row, n = self._row, len(decodes)
        here = {c.request_id for c in decodes}
        for rid in [r for r in row if r not in here]:
            del row[rid]
        taken = set(row.values())
        holes = iter([r for r in range(n) if r not in taken])
        for rid, r in list(row.items()):
            if r >= n:  # past the batch's end: into a hole
                row[rid] = next(holes)
        out: list[SeqChunk | None] = [None] * n
        for c in decodes:
            r = row.get(c.request_id)
            if r is None:
                r = row[c.request_id] = next(holes)
            out[r] = c
        return out  # type: ignore[return-value]

    def update(self, tables: list[tuple[int, ...]], rows: int) -> torch.Tensor:
        """Make the first `len(tables)` rows hold `tables`; returns the `[rows, W]` view a
        bucket of `rows` reads (rows past `len(tables)`: padding, whatever they hold)."""
        held, w = self._held, self.width
        at: list[int] = []
        ids: list[int] = []
        for r, t in enumerate(tables):
            prev = held[r]
            if t == prev:  # the common step: no new block (same ints: pointer compares)
                continue
            n = len(prev)
            first = n if n < len(t) and t[:n] == prev else 0  # grew: only the new blocks
            at.extend(range(r * w + first, r * w + len(t)))
            ids.extend(t[first:])
            held[r] = t
        if at:
            self.written += len(at)
            seg_at, seg_ids = self._buf.add(at), self._buf.add(ids)
            dev = self._buf.upload()
            self._flat.index_copy_(0, dev[seg_at[0]:seg_at[0] + seg_at[1]].long(),
                                   dev[seg_ids[0]:seg_ids[0] + seg_ids[1]])
        return self.table[:rows]


class ModelRunner:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None):
        """`num_blocks=None`: size the KV cache once the weights are loaded (on a GPU,
        from the memory they leave; see engine.memory)."""
        self.config = config
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # a CPU step binds nothing: the per-thread CUDA binding is looked up only on CUDA
        self.bind = ThreadBinder(device) if device.type == "cuda" else _no_binding
        self.bind()
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        self.backend = get_backend(config.attention_backend, self.device)
        # tensor parallelism: this rank's heads and MLP rows (the whole model without TP)
        self.group, self.shard = rank_shard(config)
        if self.group is None:
            self.model = load_model(config.model, config.model_dir, self.device, self.dtype)
        else:
            self.model = load_shard(config.model, config.model_dir, self.shard, self.device,
                                    self.dtype)
        self.model.fuse()  # q/k/v and gate/up as single GEMMs (fewer, larger kernels)
        if can_pack(self.device, self.dtype):
            self.model.pack()  # CPU GEMMs of 2+ rows on oneDNN-packed weights
            if self.backend.name == "cpu" and self.group is None:  # its library is loaded
                self.model.use_cpu_glue()
        memory = device_memory(self.device) if self.device.type == "cuda" else None
        if num_blocks is None:
            num_blocks = num_kv_blocks(config, memory=memory)
        elif memory is not None:
            check_kv_fits(config, num_blocks, free=memory[0])
        if self.group is not None:  # every rank of a group holds as many blocks
            num_blocks = self.group.agree_min(num_blocks)
        self.num_blocks = num_blocks
        self.kv = KVCache(self.shard.local_config(config.model), num_blocks, self.block_size,
                          self.dtype, self.device, kv_head_start=self.shard.kv_heads[0])
        self._buf = _StepBuffer(self.device)
        self.compiled: CompiledStep | None = None  # eager until built below
        self._compiling = False
        if warms_kernels(self):
            self.warmup()
        mode = runner_mode(config.compile, config.tensor_parallel_size)
        compiled = CompiledStep(self.model, self.device, mode, config.scheduler.max_num_seqs)
        max_len = min(config.scheduler.max_model_len, num_blocks * self.block_size)
        self._graph_width = -(-max_len // self.block_size)  # a CUDA graph's block tables
        if compiled.buckets:
            rows = compiled.buckets[-1]
            # ids, pos, slots, dlens, and up to 2 rows of logits per decode (sampled +
            # all_logits), plus alignment; the tables are the graph tables' (counted in the
            # KV sizing's reserve: engine.memory)
            self._graph_buf = _StepBuffer(self.device, 6 * rows + 64)
            self._graph_tables = _GraphTables(rows, self._graph_width, self.device)
        self.compiled = compiled
        compiled.warmup(functools.partial(run_padding, self))
        # compile "none" (or a failed start-up): steps never consult engine.compile
        self._compiling = compiled.mode != "none"
        # the thread that recorded the CUDA graphs: cudagraph trees belong to it (another
        # thread's step asserts, on torch before 2.12, or records them all again)
        self.thread = threading.get_ident()
        self._warned_thread = False
        if not self._compiling and self.model.cpu_stack is not None:
            drop_onednn(self.model)  # its row-block copies serve every row

    @staticmethod
    def _table(buf: _StepBuffer, tables: list[tuple[int, ...]]) -> tuple[int, int, int]:
        """Block tables padded with block 0 to the longest: (offset, rows, width)."""
        width = max((len(t) for t in tables), default=0)
        flat: list[int] = []
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (width - len(t)))
        off, _ = buf.add(flat)
        return off, len(tables), width

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
        compiled = self.compiled
        fn = compiled.forward_for(decode_only=not prefills) if self._compiling else None
        graph_rows = 0  # a padded (CUDA-graph) step's bucket
        if fn is not None and compiled.padded and not prefills:
            rows = compiled.bucket(len(decodes))
            if rows in compiled.buckets and all(len(c.block_ids) <= self._graph_width
                                                for c in decodes):
                graph_rows = rows
                decodes = self._graph_tables.place(decodes)  # each request keeps its row
            else:
                fn = None  # no graph of that size: eager
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
        buf, graph_tables = self._buf, None
        dtables = [c.block_ids for c in decodes]
        if graph_rows:
            if compiled.graphs and threading.get_ident() != self.thread:
                self._other_thread()
            pad = graph_rows - len(decodes)  # rows that write nowhere and read one key
            ids += [0] * pad
            pos += [0] * pad
            slots += [-1] * pad
            buf = self._graph_buf
            graph_tables = self._graph_tables.update(dtables, graph_rows)
        # decode side: the GPU waits for KV still arriving into blocks this step reads
        self.kv.wait_imports(b for c in ordered for b in c.block_ids)
        logits = self._forward(fn, buf, ids, pos, slots, dtables, [c.end for c in decodes],
                               [c.block_ids for c in prefills],
                               [len(c.token_ids) for c in prefills],
                               [c.end for c in prefills], sample_rows + full_rows,
                               graph_tables)
        if not full_ids:
            return StepLogits(sample_ids, logits, {})
        full, at = {}, len(sample_rows)
        for rid, n in full_ids:
            full[rid] = logits[at:at + n]
            at += n
        return StepLogits(sample_ids, logits[:len(sample_rows)], full)

    def _forward(self, fn, buf: _StepBuffer, ids, pos, slots, dtables, dlens, ptables, qlens,
                 plens, rows, graph_tables: torch.Tensor | None = None) -> torch.Tensor:
        """Pack, upload and run one step (compiled `fn`, or eager when None); returns the
        logits of `rows` (the sampled rows, then those of all_logits chunks; padding rows
        follow the real ones, so no row index moves). The segments the forward reads come
        first, in a fixed order: a padded decode batch of one bucket always has the same
        layout (a CUDA graph reads it in place); `rows`, read outside the graph, comes last.
        `graph_tables`: a padded step's decode tables `[bucket, W]` (_GraphTables), which
        then replace `dtables`."""
        n_dec = len(dtables) if graph_tables is None else graph_tables.shape[0]
        dlens = dlens + [1] * (n_dec - len(dlens))  # padding rows see one key
        q_starts = [0]
        for n in qlens:
            q_starts.append(q_starts[-1] + n)
        seg = {"ids": buf.add(ids), "pos": buf.add(pos), "slots": buf.add(slots),
               "dlens": buf.add(dlens), "qsl": buf.add(q_starts), "plens": buf.add(plens)}
        dtab = None if graph_tables is not None else self._table(buf, dtables)
        ptab = self._table(buf, ptables)
        seg["rows"] = buf.add(rows)
        dev = buf.upload()

        def view(name: str) -> torch.Tensor:
            off, n = seg[name]
            return dev[off:off + n]

        def table(t: tuple[int, int, int]) -> torch.Tensor:
            off, rows, w = t
            return dev[off:off + rows * w].view(rows, w)

        meta = AttentionMetadata(
            backend=self.backend,
            slot_mapping=view("slots"),
            num_decode_tokens=n_dec,
            decode_block_tables=graph_tables if dtab is None else table(dtab),
            decode_seq_lens=view("dlens"),
            prefill_block_tables=table(ptab),
            prefill_query_start_loc=view("qsl"),
            prefill_seq_lens=view("plens"),
        )
        model = self.model
        hidden = None
        if fn is not None:  # the compiled ops read the caches and weights from the context
            with step_context(meta, self.kv.k, self.kv.v, model.packed):
                try:
                    hidden = self.compiled.run(fn, view("ids"), view("pos"))
                except Exception as e:  # noqa: BLE001 - a compiled step that fails: go eager
                    self.compiled.disable(e)
        if hidden is None:  # eager (re-running a failed step rewrites the same KV slots)
            hidden = model(view("ids"), view("pos"), self.kv.k, self.kv.v, meta)
        return model.compute_logits(hidden.index_select(0, view("rows")))

    def _other_thread(self) -> None:
        if not self._warned_thread:
            self._warned_thread = True
            log.warning("a CUDA-graph step runs on thread %s, not on thread %s that built the "
                        "runner and recorded its graphs: build the engine on the thread that "
                        "steps it (runtime.loop.WorkerLoop(build=...))",
                        threading.get_ident(), self.thread)

    def warmup(self) -> None:  # every attention kernel variant serving launches, compiled
        warm_kernels(self, SeqChunk)
