"""Paged KV tensors, slot arithmetic, and export/import of token ranges for kv_transfer.

All layers live in one tensor `[L, 2 (K,V), num_blocks, block_size, KVH, D]`; the
attention backends get per-layer views `k[l]`, `v[l]` (`[num_blocks, block_size, KVH, D]`,
contiguous). Seen as `[L, 2, slots, KVH, D]`, a token range of every layer is one
`index_select` along the slot dim, already in the wire layout `[L, 2, T, KVH, D]`.

On CUDA, export and import run on a side stream: the gather (one kernel) and a
non-blocking copy into pinned host memory (from torch's caching host allocator, so the
buffers are reused), gated by events, so the engine's stream never waits for PCIe. An
import's copy and scatter are ordered after the steps already queued (its blocks may just
have been freed by one of them), and a later step waits, on the GPU, only for imports
into the blocks it reads. On CPU both are one plain tensor op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.device import ThreadBinder, pinned_empty, to_device


def slots_for(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of global token indices [start, end): `block[i // bs] * bs + i % bs`.

    Built per block, not per token: a run of slots inside one block is one range."""
    out: list[int] = []
    i = start
    while i < end:
        off = i % block_size
        n = min(block_size - off, end - i)
        base = block_ids[i // block_size] * block_size
        out.extend(range(base + off, base + off + n))
        i += n
    return out


@dataclass
class PendingExport:
    """An export whose device-to-host copy may still be in flight: `payload` is a CPU
    tensor that holds the KV once `wait()` returns (at once on CPU)."""

    payload: torch.Tensor
    event: torch.cuda.Event | None = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.payload


def layer_bounds(num_layers: int, groups: int) -> tuple[int, ...]:
    """Ends of ``groups`` near-equal groups of ``num_layers`` layers (fewer when there are
    fewer layers): the boundaries of a layer-wise export."""
    n = max(1, min(groups, num_layers))
    return tuple(sorted({round(num_layers * (i + 1) / n) for i in range(n)}))


FIRST_TOKEN_TIMEOUT_S = 60.0  # the step that samples it has ended long before; a bug else


class LayerwiseExport:
    """The KV of a prompt's final chunk, exported group by group of layers while its step
    still runs: ``kv_transfer.base.LayersReady`` (docs/design.md §4).

    ``wait_layers(n)`` returns once ``payload[:n]`` holds the KV (``waits[i]`` blocks for
    group ``i``'s copy); the last group also waits for the step's sampled first token
    (``bind_first_token``, by the engine once the step's result is in; ``None``: no
    token travels, e.g. the request ended at it), which the sender then puts on the
    chunk's last piece (``first_token``). ``fail`` (before that) makes every later wait
    raise."""

    def __init__(self, payload: torch.Tensor, boundaries: Sequence[int],
                 waits: Sequence[Callable[[], object]]):
        self.payload = payload
        self.boundaries = tuple(boundaries)
        self._waits = dict(zip(self.boundaries, waits, strict=True))
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self.first_token: int | None = None

    def wait_layers(self, n: int) -> torch.Tensor:
        if self._error is not None:
            raise RuntimeError(f"the step computing this chunk failed: {self._error}")
        self._waits[n]()
        if n == self.boundaries[-1]:
            if not self._bound.wait(FIRST_TOKEN_TIMEOUT_S):
                raise TimeoutError("the step's first token was never bound to its chunk")
            if self._error is not None:
                raise RuntimeError(f"the step computing this chunk failed: {self._error}")
        return self.payload[:n]

    def bind_first_token(self, token: int | None) -> None:
        self.first_token = token
        self._bound.set()

    def fail(self, error: BaseException) -> None:
        """Fail every later wait, unless the first token was bound already."""
        if not self._bound.is_set():
            self._error = error
            self._bound.set()


class KVCache:
    """Per layer K and V caches, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_head_start: int = 0,
    ):
        """`kv_head_start`: the model's index of this cache's first KV head (a
        tensor-parallel rank holds heads [kv_head_start, kv_head_start + KVH))."""
        self.kv_head_start = kv_head_start
        self.num_layers = model.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.bind = ThreadBinder(self.device)  # called on CUDA paths only
        self.bind()
        kvh, d = model.num_kv_heads, model.head_dim
        self.data = torch.zeros((model.num_layers, 2, num_blocks, block_size, kvh, d),
                                dtype=dtype, device=self.device)
        self.k = [self.data[layer, 0] for layer in range(model.num_layers)]
        self.v = [self.data[layer, 1] for layer in range(model.num_layers)]
        self._slots = self.data.view(model.num_layers, 2, num_blocks * block_size, kvh, d)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._imports: list[tuple[torch.cuda.Event, frozenset[int]]] = []
        # pinned sources of imports in flight, each held until its copy is done
        self._held: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    @staticmethod
    def bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
        """K+V bytes of one token over all layers (one token of a KV transfer)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return model.num_layers * 2 * model.num_kv_heads * model.head_dim * elem

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_token(model, dtype) * block_size

    def _slot_index(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        return to_device(slots_for(block_ids, start, end, self.block_size), torch.long,
                         self.device)  # pinned, non-blocking on CUDA

    # ---- export (prefill side) -----------------------------------------------------------
    def export_async(self, block_ids: Sequence[int], start: int, end: int) -> PendingExport:
        """Start copying the KV of tokens [start, end) to a CPU tensor `[L, 2, T, KVH, D]`."""
        if not self._cuda:
            return PendingExport(self._slots.index_select(2, self._slot_index(
                block_ids, start, end)))
        self.bind()
        idx = self._slot_index(block_ids, start, end)
        shape = (self.num_layers, 2, end - start) + tuple(self._slots.shape[3:])
        host = pinned_empty(shape, self.dtype)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # this step's KV writes
        with torch.cuda.stream(side):
            idx.record_stream(side)
            staged = self._slots.index_select(2, idx)  # one gather over every layer
            # later main-stream writes (these blocks freed and reused) wait for the gather
            gathered = torch.cuda.Event()
            gathered.record(side)
            host.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        torch.cuda.current_stream(self.device).wait_event(gathered)
        return PendingExport(host, event)

    def export_layerwise(self, block_ids: Sequence[int], start: int, end: int,
                         groups: int) -> LayerwiseExport:
        """``export_async`` of tokens [start, end) of the step just launched, by groups of
        layers. Here every group is ready when the whole copy is: a synchronous CPU forward
        has written every layer by now, and on CUDA the copy follows the whole step (the
        forward records no event per layer group: the layer loop runs inside the model's,
        possibly compiled, forward). The emulated device's cache
        (engine/emulate/runner.py) readies each group at its share of the step."""
        pending = self.export_async(block_ids, start, end)
        bounds = layer_bounds(pending.payload.shape[0], groups)
        return LayerwiseExport(pending.payload, bounds, [pending.wait] * len(bounds))

    def export_tokens(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """KV of tokens [start, end) as one contiguous CPU tensor `[L, 2, T, KVH, D]`."""
        return self.export_async(block_ids, start, end).wait()

    # ---- import (decode side) ------------------------------------------------------------
    def import_tokens(
        self, block_ids: Sequence[int], start: int, data: torch.Tensor, layer_start: int = 0,
        head_start: int | None = None,
    ) -> None:
        """Write `data` `[L', 2, T, H', D]` as the KV of global tokens [start, start + T)
        for layers [layer_start, layer_start + L') and the model's KV heads [head_start,
        head_start + H') (default: this cache's heads). `data` may be released at once;
        on CUDA the device copy completes asynchronously, from pinned `data` itself (which
        is then held until the copy is done: its owner must not write to it meanwhile, as
        kv_transfer's buffer pool reuses a buffer only once nobody references it), else
        through a pinned copy made before this returns."""
        num_tokens = data.shape[2]
        layers = slice(layer_start, layer_start + data.shape[0])
        assert data.shape[1] == 2 and layers.stop <= self.num_layers, data.shape
        dst = self._slots[layers]  # [L', 2, slots, KVH, D]
        h0 = (self.kv_head_start if head_start is None else head_start) - self.kv_head_start
        if (h0, data.shape[3]) != (0, dst.shape[3]):
            if not 0 <= h0 < h0 + data.shape[3] <= dst.shape[3]:
                raise ValueError(
                    f"KV heads [{h0 + self.kv_head_start}, "
                    f"{h0 + self.kv_head_start + data.shape[3]}) are not among this cache's "
                    f"[{self.kv_head_start}, {self.kv_head_start + dst.shape[3]})")
            dst = dst[:, :, :, h0:h0 + data.shape[3]]  # a view: index_copy_ writes through
        if not self._cuda:
            dst.index_copy_(2, self._slot_index(block_ids, start, start + num_tokens),
                            data.to(self.dtype))
            return
        self.bind()
        idx = self._slot_index(block_ids, start, start + num_tokens)
        if data.is_pinned() and data.dtype == self.dtype and data.is_contiguous():
            # a pinned receive buffer (kv_transfer/buffers.py): copied to the device from
            # where it is, and held until the copy is done (its pool reuses it only once
            # nobody references it)
            staging = data
        else:  # pageable: a host memcpy (+ cast) into pinned memory, here and now
            staging = pinned_empty(data.shape, self.dtype).copy_(data)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # blocks freed by queued steps
        with torch.cuda.stream(side):
            idx.record_stream(side)
            dev = staging.to(self.device, non_blocking=True)
            dst.index_copy_(2, idx, dev)
            event = torch.cuda.Event()
            event.record(side)
        first, last = start // self.block_size, (start + num_tokens - 1) // self.block_size
        self._imports.append((event, frozenset(block_ids[first:last + 1])))
        self._held = [h for h in self._held if not h[0].query()]
        if staging is data:
            self._held.append((event, data))

    def wait_imports(self, block_ids: Iterable[int]) -> None:
        """Make the current stream wait (on the GPU; the host goes on) for imports into
        any of `block_ids`; forget imports that have completed."""
        if not self._imports:
            return
        wanted = set(block_ids)
        stream = torch.cuda.current_stream(self.device)
        pending = []
        for event, blocks in self._imports:
            if event.query():
                continue
            if blocks & wanted:
                stream.wait_event(event)
            else:
                pending.append((event, blocks))
        self._imports = pending
        self._held = [h for h in self._held if not h[0].query()]
