"""Timings for `pdserve calibrate`, taken with the real engine on this machine.

Every figure is the fastest (``stat="min"``: the machine's cost without interference
from other processes) or the median (``stat="median"``: its cost under the load it has
now, for a simulation compared with runs taken under that load) of ``repeats`` runs after
one warm-up, with the device synchronised around it on CUDA. Prefill and decode steps run ``ModelRunner.execute`` on
chunks with real block tables (KV contents are whatever the cache holds: the cost does
not depend on them); decode sequences get distinct blocks while ``kv_budget_bytes``
allows, then share them cyclically. Step overheads run the real PrefillEngine and
DecodeEngine with an in-process connector and subtract the model, sampling and KV copy
time measured inside the same steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sim.adapters import engine_tools

STATS = {"min": min, "median": statistics.median}


class Measurer:
    def __init__(self, model_dir: str, *, device: str, dtype: str, backend: str,
                 block_size: int, max_model_len: int, max_batch_tokens: int, max_seqs: int,
                 repeats: int, kv_budget_bytes: int, stat: str = "min"):
        if stat not in STATS:
            raise ValueError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
        self.T = T = engine_tools()
        self.stat = stat
        self.model_dir, self.repeats = model_dir, repeats
        self.model = T.load_model_config(model_dir)
        self.block_size, self.max_len = block_size, max_model_len
        per_block = (self.model.num_layers * 2 * self.model.num_kv_heads * self.model.head_dim
                     * torch.empty((), dtype=getattr(torch, dtype)).element_size() * block_size)
        need = max_seqs * -(-max_model_len // block_size) + 2 * -(-max_model_len // block_size)
        self.num_blocks = max(2 * -(-max_model_len // block_size) + 1,
                              min(need, kv_budget_bytes // per_block))
        self.cfg = T.EngineConfig(
            model_dir=model_dir, model=self.model,
            cache=T.CacheConfig(block_size, self.num_blocks, enable_prefix_caching=False),
            scheduler=T.SchedulerConfig(max_num_batched_tokens=max_batch_tokens,
                                        max_num_seqs=max_seqs, max_model_len=max_model_len),
            device=device, dtype=dtype, attention_backend=backend)
        self.runner = T.ModelRunner(self.cfg, self.num_blocks)
        self.cuda = self.runner.device.type == "cuda"
        self.vocab = self.model.vocab_size

    # ---- timing ---------------------------------------------------------------------
    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.runner.device)

    def time(self, fn: Callable[[], Any], repeats: int | None = None) -> float:
        fn()  # warm-up
        out = []
        for _ in range(repeats or self.repeats):
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            out.append(time.perf_counter() - t0)
        return self.reduce(out)

    def reduce(self, timings: Sequence[float]) -> float:
        """The figure kept of repeated timings (``stat``)."""
        return float(STATS[self.stat](timings))

    def _table(self, n_tokens: int, offset: int = 0) -> tuple[int, ...]:
        nb = -(-n_tokens // self.block_size)
        return tuple((offset + i) % self.num_blocks for i in range(nb))

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(1 + (i * 7919) % (self.vocab - 1) for i in range(n))

    # ---- steps ----------------------------------------------------------------------
    def prefill_chunks(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One step over chunks (C new tokens after P cached), as a prefill worker runs it."""
        seqs, off = [], 0
        for i, (c, p) in enumerate(chunks):
            table = self._table(p + c, off)
            off += len(table)
            seqs.append(self.T.SeqChunk(f"p{i}", self._tokens(c), p, table, sample=True))
        return self.time(lambda: self.runner.execute(seqs))

    def decode_batch(self, contexts: Sequence[int]) -> float:
        """One decode step: one new token for each sequence, attending ``L`` tokens."""
        seqs, off = [], 0
        for i, ctx in enumerate(contexts):
            table = self._table(ctx, off)
            off += len(table)
            seqs.append(self.T.SeqChunk(f"d{i}", (5,), ctx - 1, table, sample=True))
        return self.time(lambda: self.runner.execute(seqs))

    def sampling(self, rows: int) -> float:
        logits = torch.randn(rows, self.vocab)
        params = [self.T.SamplingParams(temperature=0.0, max_tokens=8)] * rows
        gens = [None] * rows
        return self.time(lambda: self.T.sample(logits, params, gens))

    def kv_export(self, tokens: int) -> float:
        table = self._table(tokens)
        return self.time(lambda: self.runner.kv.export_tokens(table, 0, tokens))

    def kv_import(self, tokens: int) -> float:
        table = self._table(tokens)
        data = self.runner.kv.export_tokens(table, 0, tokens).clone()
        return self.time(lambda: self.runner.kv.import_tokens(table, 0, data))

    def payload(self, tokens: int) -> torch.Tensor:
        return self.runner.kv.export_tokens(self._table(tokens), 0, tokens).clone()
