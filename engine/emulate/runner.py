"""EmulatedRunner: ModelRunner's interface on an emulated accelerator.

A step costs what the cost model (engine/costs/) gives for exactly that batch -- the
prefill chunks' sizes and contexts, the decode batch and its contexts, the sampled rows
-- on the device timeline (engine/emulate/device.py); KV exports and imports cost their
copies there too. Meanwhile the host does the model's real memory work: each token's KV,
of the shape's true size (its layers sent, with --emulate-kv-fraction), is written into
a real paged cache (engine/emulate/kv_pattern.py), exported and imported as the real
runner's is, and every range imported is checked. Then the host waits for the step's
end, without the GIL. A decode token's KV, which never leaves its worker (a preempted
leg is recomputed by a prefill worker), is written one word per (layer, K/V) -- the word
a later step reads back -- not tiled over its whole size: at batch 256 of llama-3-8b the
full tiles cost this host ~100 ms a step.

The emulated model's next token after position ``i`` is a hash of the KV state there
(``h[i]``: the tokens up to ``i``) and of the request's draw key -- 0 for greedy rows,
the seed for seeded ones, a fresh random key per request otherwise -- inside the
vocabulary: greedy streams are a function of the prompt alone, the same colocated or
disaggregated, and a decode worker reads the state off the KV it received. EOS, stop
tokens and max_tokens end requests as usual; log-probs have their usual shapes (the
chosen token at log-prob 0, rank 1, then the next candidates of the hash).

The engines reach it through engine.execute.execute_and_sample (``samples_itself``):
no logits exist, so no [rows, vocab] tensor is built.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Sequence

import numpy as np
import torch

from engine.config import EngineConfig, torch_dtype
from engine.costs.analytic import analytic_calibration
from engine.costs.calibration import Calibration
from engine.costs.loader import load_costs
from engine.costs.model import CostModel
from engine.emulate.device import DeviceEvent, EmulatedDevice
from engine.emulate.kv_pattern import (
    ROOT,
    KVPattern,
    chain,
    mix,
    mix_np,
    slot_runs,
    step_np,
)
from engine.execute import Sampled, StepLaunch
from engine.kv_cache import KVCache, LayerwiseExport, PendingExport, layer_bounds, slots_for
from engine.logprobs import TokenLogprobs
from engine.memory import num_kv_blocks

_M64 = (1 << 64) - 1
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # as kv_transfer/buffers.py
POOLED_BYTES = 1 << 20  # export buffers at least this big are reused (EmulatedKV._payload)
POOLED_BUFFERS = 4  # about the exports a link holds at once (its credit window)


def emulated_costs(config: EngineConfig) -> CostModel:
    """The cost model of ``config.emulate``: an analytic profile for its shape, or a
    calibration file."""
    em = config.emulate
    assert em is not None
    if em.costs.endswith(".json"):
        return load_costs(Calibration.load(em.costs))
    return load_costs(analytic_calibration(em.costs, em.shape, config.dtype))


def written_blocks(block_ids: Sequence[int], start: int, end: int,
                   block_size: int) -> frozenset[int]:
    """The blocks that hold tokens [start, end)."""
    return frozenset(block_ids[start // block_size:(max(start, end - 1)) // block_size + 1])


def _token(h: int, key: int, vocab: int) -> int:
    return mix(h ^ key) % vocab


class ExportEvent(DeviceEvent):
    """An export's copy: done once the device's clock passes its end and the bytes are
    gathered (once, by whichever thread comes first)."""

    def __init__(self, device: EmulatedDevice, at: float, slots: torch.Tensor,
                 idx: torch.Tensor, out: torch.Tensor, blocks: frozenset[int] = frozenset()):
        super().__init__(device, at)
        self.blocks = blocks  # the cache blocks it reads
        self._src: tuple | None = (slots, idx, out)
        self._lock = threading.Lock()

    @property
    def gathered(self) -> bool:
        return self._src is None

    def gather(self) -> None:
        with self._lock:
            if self._src is not None:
                slots, idx, out = self._src
                torch.index_select(slots, 2, idx, out=out)
                self._src = None

    def query(self) -> bool:
        if not super().query():
            return False
        self.gather()
        return True

    def synchronize(self) -> None:
        super().synchronize()
        self.gather()


class EmulatedKV(KVCache):
    """The paged cache, real bytes; exports and imports charge the device's copy engine
    (one queue with the steps: the simulator's accounting) and imports are checked."""

    def __init__(self, runner: EmulatedRunner, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runner = runner
        self.words = self._slots.view(torch.int64)  # [L, 2, slots, KVH, Q]
        self.checked_ranges = 0
        self._exports: list[ExportEvent] = []  # gathers not done yet
        self._pool: list[torch.Tensor] = []  # export buffers lent (_payload)
        # per block, when the latest import into it ends on the copy engine (0.0: none);
        # the step a leg joins waits for its blocks' (imports_end)
        self.import_ends = np.zeros(self.num_blocks)

    def export_async(self, block_ids: Sequence[int], start: int, end: int) -> PendingExport:
        """As on a GPU: the copy is queued (on the device's timeline) and the caller goes
        on; the gather of the real bytes runs on the thread that waits for it (the KV
        link's), or at the latest before the next step writes the cache."""
        r = self.runner
        idx = self._slot_index(block_ids, start, end)
        layers = r.layers_sent  # (all but with --emulate-kv-fraction)
        payload = self._payload((layers, 2, end - start, *self._slots.shape[3:]))
        done = r.accel.submit(r.costs.kv_export_s(max(1, end - start)))  # the full size
        ev = ExportEvent(r.accel, done, self._slots[:layers], idx, payload,
                         written_blocks(block_ids, start, end, self.block_size))
        self._exports.append(ev)
        return PendingExport(payload, ev)

    def export_layerwise(self, block_ids: Sequence[int], start: int, end: int,
                         groups: int) -> LayerwiseExport:
        """``export_async`` of the step just launched, by groups of layers: the step's
        layers take equal shares of its compute (the analytic profile's layers are alike;
        its lm_head's few FLOPs are spread over them), so the group ending at payload
        layer ``b`` of ``Lp`` is computed ``b / Lp`` into it (with --emulate-kv-fraction
        each sent layer stands for ``1 / F`` of the model's, as its bytes are charged);
        then its share of the export's copy runs on the copy engine, beside the compute."""
        r = self.runner
        idx = self._slot_index(block_ids, start, end)
        layers = r.layers_sent
        payload = self._payload((layers, 2, end - start, *self._slots.shape[3:]))
        bounds = layer_bounds(layers, groups)
        step_start, compute_s = r.step_window
        full = r.costs.kv_export_s(max(1, end - start))  # the full size, as export_async
        waits, lo = [], 0
        blocks = written_blocks(block_ids, start, end, self.block_size)
        for b in bounds:
            done = r.accel.copy(full * (b - lo) / layers, after=step_start + compute_s * b / layers)
            ev = ExportEvent(r.accel, done, self._slots[lo:b], idx, payload[lo:b], blocks)
            self._exports.append(ev)
            waits.append(ev.synchronize)
            lo = b
        return LayerwiseExport(payload, bounds, waits)

    def _payload(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An export's host buffer: one of those lent before that nobody holds any more
        (its storage's use count: the pool's reference alone), else a fresh one. As a
        GPU's pinned caching host allocator, so no export pays a fresh buffer's page
        faults (a 32 MiB buffer's cost this host as much as its gather)."""
        n = math.prod(shape)
        for i, buf in enumerate(self._pool):
            if buf.numel() >= n and _use_count(buf.untyped_storage()._cdata) == 1:
                self._pool.append(self._pool.pop(i))  # most recently lent last
                return buf.view(-1)[:n].view(shape)
        out = torch.empty(shape, dtype=self.dtype)
        if _use_count is not None and out.nbytes >= POOLED_BYTES:
            self._pool.append(out)
            del self._pool[:-POOLED_BUFFERS]
        return out

    def finish_exports(self, blocks: frozenset[int] | None = None) -> None:
        """Gather the exports still pending that read any of ``blocks`` (None: every one),
        the blocks a step is about to write (freed since an export, they may be written;
        on a GPU the step's stream waits for the gathers). The others stay for the KV link
        thread that waits for them, off this thread: a prefill chunk's write never touches
        the blocks of the chunk before it."""
        keep = []
        for ev in self._exports:
            if blocks is None or ev.blocks & blocks:
                ev.gather()
            elif not ev.gathered:
                keep.append(ev)
        self._exports = keep

    def import_tokens(self, block_ids: Sequence[int], start: int, data: torch.Tensor,
                      layer_start: int = 0, head_start: int | None = None) -> None:
        self.charge_import(block_ids, start, data.shape[2])
        self.copy_in(block_ids, start, data, layer_start=layer_start, head_start=head_start)

    def copy_in(self, block_ids: Sequence[int], start: int, data: torch.Tensor,
                layer_start: int = 0, head_start: int | None = None) -> None:
        """The host's part of an import: the range checked (PatternError fails the leg)
        and copied into the cache; any thread (decode_worker/intake.py runs it off the
        loop, into blocks no step reads yet)."""
        self.runner.pattern.check(data, start, layer_start)
        heads = self.kv_head_start if head_start is None else head_start
        if (heads, data.shape[3]) != (self.kv_head_start, self._slots.shape[3]) or \
                data.dtype != self.dtype:
            super().import_tokens(block_ids, start, data, layer_start, head_start)
        else:  # every head: a block's run of slots is one slice, one copy (not index_copy_'s
            # slab per token: half this host's time of a range's copy)
            dst = self._slots[layer_start:layer_start + data.shape[0]]
            slots = slots_for(block_ids, start, start + data.shape[2], self.block_size)
            for i, j in slot_runs(slots):
                dst[:, :, slots[i]:slots[j - 1] + 1].copy_(data[:, :, i:j])
        self.checked_ranges += 1

    def charge_import(self, block_ids: Sequence[int], start: int, num_tokens: int) -> None:
        """The device's part of importing tokens [start, start + num_tokens) of a leg
        whose blocks are ``block_ids``: the copy on the copy engine, after the steps
        queued before it (its blocks may have been freed by one of them), as the CUDA
        cache's side stream; the step the leg joins waits for the blocks it writes
        (``imports_end``). On the steps' thread: the device's timeline has one writer."""
        r, bs = self.runner, self.block_size
        end = r.accel.copy(r.costs.kv_import_s(max(1, num_tokens)), after=r.accel.free_at)
        self.import_ends[list(block_ids[start // bs:(start + max(1, num_tokens) - 1) // bs
                                        + 1])] = end

    def imports_end(self, tables: Sequence[Sequence[int]]) -> float:
        """When the imports into the blocks of ``tables`` end (0.0: none), as the CUDA
        cache's ``wait_imports``: the copy engine's later imports, into other legs'
        blocks, are not waited for. (A copy never ends before one queued before it, so a
        block's latest import is the one that counts.)"""
        blocks = [b for t in tables for b in t]
        return float(self.import_ends[blocks].max()) if blocks else 0.0


class EmulatedRunner:
    """ModelRunner's interface (``kv``, ``num_blocks``, ``config``, ``bind``) on the
    emulated device; ``execute_and_sample`` instead of ``run``."""

    samples_itself = True

    def __init__(self, config: EngineConfig, num_blocks: int | None = None):
        em = config.emulate
        if em is None:
            raise ValueError("EmulatedRunner needs config.emulate")
        self.config = config
        self.costs = emulated_costs(config)
        self.label = f"{em.label} ({self.costs.label.removeprefix('analytic, not measured: ')})"
        self.device = torch.device("cpu")  # where its tensors live (ModelRunner's meaning)
        self.accel = EmulatedDevice(time_scale=em.time_scale)  # the accelerator's timeline
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        model = config.model
        elem = torch.empty((), dtype=self.dtype).element_size()
        if model.head_dim * elem % 8:
            raise ValueError(f"emulated KV needs head_dim x element size divisible by 8 "
                             f"bytes, got {model.head_dim} x {elem}")
        if config.tensor_parallel_size != 1:
            raise ValueError("the emulated device runs one rank per worker "
                             "(tensor_parallel_size 1)")
        self.num_blocks = num_blocks if num_blocks is not None else num_kv_blocks(config)
        per_token = KVCache.bytes_per_token(model, self.dtype)
        capacity = self.num_blocks * self.block_size
        need = config.scheduler.max_model_len
        if capacity < need:
            raise ValueError(
                f"{em.label}: the KV pool holds {capacity} tokens ({self.num_blocks} blocks "
                f"of {self.block_size}, {per_token / 1024:g} KiB per token of {em.shape}: "
                f"{self.num_blocks * self.block_size * per_token / (1 << 30):.2f} GiB), less "
                f"than one request of max_model_len {need}: raise the KV memory budget "
                "(--kv-cache-memory-gb / cache.kv_cache_memory_bytes) or lower "
                "--max-model-len")
        self.kv = EmulatedKV(self, model, self.num_blocks, self.block_size, self.dtype, "cpu")
        self.pattern = KVPattern(model.num_layers, max(model.max_position_embeddings,
                                                        config.scheduler.max_model_len))
        self.vocab = model.vocab_size
        self.layers_sent = em.layers_sent(model.num_layers)
        # a prompt token's KV is written for the layers sent only: with
        # --emulate-kv-fraction the others are never read (not sent, not checked; a
        # state is read off layer 0), and writing them would make this host, not the
        # emulated device, set a prefill step's pace (128 KiB a token of llama-3-8b)
        self.prompt_pattern = self.pattern if self.layers_sent == model.num_layers else \
            KVPattern(self.layers_sent, self.pattern.salt.shape[2])  # the same first layers
        self._last: set[str] = set()  # request ids of the previous step
        # the latest step's (start on the device timeline, seconds of its layers' compute:
        # all but the sampled rows'); a layer-wise export times its groups by it
        self.step_window: tuple[float, float] = (self.accel.created, 0.0)
        self._keys: dict[str, int] = {}  # unseeded sampling: one random key per request
        self._rng = random.Random()

    def bind(self) -> None:
        """No device thread binding (ModelRunner.bind's place)."""

    def stats(self) -> dict[str, float]:
        return {**self.accel.stats(), "kv_checked_ranges": float(self.kv.checked_ranges)}

    # ---- one step ---------------------------------------------------------------------
    def step_cost_s(self, items, chunks, joins: bool) -> float:
        """The device time of one batch (its ScheduledItems and their SeqChunks): the
        prefill chunks' compute, the decode rows' (``joins``: a decode leg joins the
        batch), and the sampled rows'."""
        c = self.costs
        pre = [(len(ch.token_ids), ch.start) for it, ch in zip(items, chunks, strict=True)
               if it.is_prefill]
        dec = [ch for it, ch in zip(items, chunks, strict=True) if not it.is_prefill]
        cost = c.prefill_s(pre) if pre else 0.0
        if dec:
            ends = [ch.end for ch in dec]
            cost += c.decode_s(len(dec), sum(ends), max(ends))
            if joins:
                cost += c.leg_join_s()
        rows = sum(1 for ch in chunks if ch.sample)
        return cost + (c.sample_s(rows) if rows else 0.0)

    def execute_and_sample(self, items) -> list:
        """engine.execute.execute_and_sample on the emulated device: the step queued at
        once, the KV written while it runs, the host back when it ends."""
        return self.launch(items).result()

    def launch(self, items) -> StepLaunch:
        """engine.execute.launch_and_sample: the step queued and its KV written; the
        handle's ``result()`` waits for the step's end on the device's timeline (the ids
        are the host's at once here, but an engine reads them only from the handle)."""
        chunks = [it.to_chunk() for it in items]
        ids = {ch.request_id for ch in chunks}
        joining = [ch.block_ids for it, ch in zip(items, chunks, strict=True)
                   if not it.is_prefill and ch.request_id not in self._last]
        cost = self.step_cost_s(items, chunks, bool(joining))
        # a joining leg reads its imported blocks: the step starts once their copies end
        done = self.accel.submit(cost, continues=bool(ids & self._last),
                                 after=self.kv.imports_end(joining))
        rows = sum(1 for ch in chunks if ch.sample)
        k = self.accel.time_scale
        self.step_window = (done - cost * k,
                            (cost - (self.costs.sample_s(rows) if rows else 0.0)) * k)
        self._last = ids
        bs, kv, pattern = self.block_size, self.kv, self.pattern
        dec = [i for i, it in enumerate(items) if not it.is_prefill]
        decoded = self._decode_rows([items[i] for i in dec], [chunks[i] for i in dec]) \
            if dec else None
        pre = [(i, it, ch) for i, (it, ch) in enumerate(zip(items, chunks, strict=True))
               if it.is_prefill]
        # a prefill chunk's state before it: the root, or off the KV at its previous position
        reads = [ch for _, _, ch in pre if ch.start > 0]
        prev = pattern.state_at(kv.words, [slots_for(ch.block_ids, ch.start - 1, ch.start,
                                                     bs)[0] for ch in reads],
                                [ch.start - 1 for ch in reads])
        before = dict(zip((ch.request_id for ch in reads), prev, strict=True))
        states, positions, slots, drawn = [], [], [], []
        for i, it, ch in pre:
            h0 = before.get(ch.request_id, ROOT)
            hs = chain(h0, ch.token_ids)
            states += hs
            positions.extend(range(ch.start, ch.end))
            slots += slots_for(ch.block_ids, ch.start, ch.end, bs)
            r = it.request
            if r.wants_prompt_logprobs:
                self._prompt_logprobs(it, h0, hs)
            if ch.sample:
                tok, lps = self._draw(r, hs[-1])
                drawn.append((i, Sampled(r, tok, lps)))
        out = [s for _, s in drawn]  # in row order
        if decoded is not None:
            out = decoded[0] if not drawn else [s for _, s in sorted(
                drawn + list(zip(dec, decoded[0], strict=True)), key=lambda x: x[0])]
        kv.finish_exports(None if any(not it.is_prefill for it in items) else frozenset(
            b for ch in chunks for b in written_blocks(ch.block_ids, ch.start, ch.end, bs)))
        self.prompt_pattern.write(kv.words[:self.layers_sent], slots, states, positions)
        if decoded is not None:
            pattern.write_sparse(kv.words, *decoded[1])
        if len(self._keys) > 4096:  # keys of requests that ended: forget them now and then
            self._keys = {k: v for k, v in self._keys.items() if k in ids}
        accel = self.accel

        def collect() -> list:
            accel.wait(done)
            return out
        return StepLaunch(collect)

    def _decode_rows(self, items, chunks) -> tuple[list[Sampled], tuple]:
        """A decode batch's rows at once: each row's state read off the KV at its previous
        position (one gather of a word per row), the state after its token (``step`` over
        the batch), its draw (``_token`` over the batch); returns the Sampled rows and the
        sparse write's (slots, states, positions), done by ``launch`` after the exports."""
        bs = self.block_size
        rslots, wslots, pos, toks, keys = [], [], [], [], []
        for it, ch in zip(items, chunks, strict=True):
            p, bt = ch.start, ch.block_ids
            rslots.append(bt[(p - 1) // bs] * bs + (p - 1) % bs)
            wslots.append(bt[p // bs] * bs + p % bs)
            pos.append(p)
            toks.append(ch.token_ids[0])
            keys.append(self._key(it.request))
        positions = np.array(pos, dtype=np.int64)
        h0 = self.pattern.states_at(self.kv.words, np.array(rslots, dtype=np.int64),
                                    positions - 1)
        h = step_np(h0, np.array(toks, dtype=np.uint64))
        key = np.array(keys, dtype=np.uint64)
        tokens = (mix_np(h ^ key) % np.uint64(self.vocab)).tolist()  # _token, row-wise
        out, hs = [], None
        for j, (it, tok) in enumerate(zip(items, tokens, strict=True)):
            r = it.request
            n = r.sampling_params.logprobs
            if n is None:
                out.append(Sampled(r, tok))
                continue
            hs = hs if hs is not None else h.tolist()
            out.append(Sampled(r, tok, self._logprobs(tok, hs[j], keys[j], n)))
        return out, (np.array(wslots, dtype=np.int64), h, positions)

    def _key(self, r) -> int:
        p = r.sampling_params
        if p.greedy:
            return 0
        if p.seed is not None:
            return mix(p.seed + 1) | 1
        key = self._keys.get(r.request_id)
        if key is None:
            key = self._keys[r.request_id] = self._rng.getrandbits(62) | 1
        return key

    def _draw(self, r, h: int) -> tuple[int, TokenLogprobs | None]:
        key = self._key(r)
        tok = _token(h, key, self.vocab)
        n = r.sampling_params.logprobs
        if n is None:
            return tok, None
        return tok, self._logprobs(tok, h, key, n)

    def _logprobs(self, tok: int, h: int, key: int, n: int) -> TokenLogprobs:
        """The chosen token first at log-prob 0 (the emulated model is certain), then
        ``n - 1`` other ids of the hash at falling log-probs."""
        top = [(tok, 0.0)]
        j = 1
        while len(top) < n:
            other = _token(h, (key + j * 0x9E37_79B9) & _M64, self.vocab)
            j += 1
            if all(other != t for t, _ in top):
                top.append((other, -float(len(top))))
        return TokenLogprobs(tok, 0.0, 1, tuple(top[:n]))

    def _prompt_logprobs(self, it, h0: int, hs: list[int]) -> None:
        """Log-probs of the prompt tokens this chunk predicts (rank by the hash: 1 where
        the emulated model would have drawn it greedily)."""
        r, k = it.request, it.request.sampling_params.prompt_logprobs
        end = min(it.start + it.num_tokens, r.num_prompt_tokens - 1)
        if r.prompt_logprobs is None:
            r.prompt_logprobs = [None]
        del r.prompt_logprobs[it.start + 1:]
        for i in range(it.start, end):
            target = r.prompt_token_ids[i + 1]
            h = hs[i - it.start]
            best = _token(h, 0, self.vocab)
            lp = 0.0 if target == best else -1.0
            top = self._logprobs(best, h, 0, k).top if k else ()
            r.prompt_logprobs.append(TokenLogprobs(target, lp, 1 if lp == 0.0 else 2, top))
