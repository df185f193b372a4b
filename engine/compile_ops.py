"""Paged attention as one opaque torch op, so that a compiled forward traces every layer.

`torch.compile` cannot trace the attention backends (the torch reference reads sequence
lengths on the host; the Triton kernels are launched by Python), so a compiled forward
calls `torch.ops.pdserve.paged_attention(q, k, v, layer, scale)` instead: an op the
compiler keeps as one call, with the KV caches and the step's AttentionMetadata taken
from a per-thread step context that ModelRunner sets around the forward (as vLLM's
forward context does). The graph's inputs are then only token ids and positions, so one
graph serves every batch shape of the same token count, and on CUDA a captured graph
reads the metadata from the runner's persistent step buffer at fixed offsets.

The eager forward calls `attend` (engine/attention/base.py) directly with the same
arguments the op looks up, and never enters this module.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.base import attend

if TYPE_CHECKING:
    from engine.attention.base import AttentionMetadata


@dataclass
class StepContext:
    meta: AttentionMetadata
    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    packed: Sequence[torch.Tensor] | None = None  # packed projection weights (models/linear.py)


_local = threading.local()


@contextmanager
def step_context(meta: AttentionMetadata, k_caches: Sequence[torch.Tensor],
                 v_caches: Sequence[torch.Tensor],
                 packed: Sequence[torch.Tensor] | None = None) -> Iterator[None]:
    """Make this step's metadata, caches and packed weights what the ops read on this
    thread."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = StepContext(meta, k_caches, v_caches, packed)
    try:
        yield
    finally:
        _local.ctx = prev


def current_context() -> StepContext | None:
    return getattr(_local, "ctx", None)


@torch.library.custom_op("pdserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    scale: float) -> torch.Tensor:
    """`attend` for layer `layer` with this thread's step context (writes the layer's KV
    cache: a side effect the graph does not see; each layer's call depends on the one
    before through `q`, so the order is kept)."""
    ctx = current_context()
    if ctx is None:
        raise RuntimeError("pdserve::paged_attention called outside ModelRunner's step context")
    out = attend(ctx.meta, q, k, v, ctx.k_caches[layer], ctx.v_caches[layer], scale)
    return out if out.is_contiguous() else out.contiguous()


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
      scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
