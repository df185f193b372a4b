"""Projection GEMMs on oneDNN-packed weights, for CPU fp32 steps of two or more rows.

Measured on the development machine (AMD EPYC, AVX-512, MKL and oneDNN of torch 2.13, one
thread, SmolLM2's 30 layers of projections, weights streamed from memory):

    rows          1     2     4    16    64   512
    MKL (ms)    28.1  39.7  55.1  79.8   182  1191   (x @ W, W stored [K, N])
    oneDNN (ms) 31.6  37.6  26.5  44.6   137  1012   (W packed once, hint 16 rows)

MKL repacks the weight on every call of a small-M GEMM; a weight packed once by oneDNN
streams at about the speed of one GEMV for up to ~8 rows. So a single row keeps MKL's
GEMV on the unpacked weight (its best case), and 2..3 rows are padded to 4 (cheaper than
their own oneDNN kernels). The packed copies cost one more copy of the projection weights
in memory; they are read instead of the originals, so bytes per step do not grow.

Packed tensors are opaque to `torch.compile`: a compiled forward calls the op
`pdserve::packed_linear`, which takes the packed weight by key from the step context
(engine/compile_ops.py), as attention takes the KV caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.compile_ops import current_context

PACK_HINT = 16  # rows oneDNN chooses its blocked layout for (best over 1..512, above)
MIN_ROWS = 4


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a `[N, K]` weight (any strides)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT)


def packed_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """`x @ W.T + bias` for x `[M, K]` (M >= 2) on the packed W."""
    m = x.shape[0]
    if m < MIN_ROWS:
        x = torch.cat((x, x.new_zeros(MIN_ROWS - m, x.shape[1])))
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out[:m] if m < MIN_ROWS else out


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            key: int | None) -> torch.Tensor:
    """`x @ weight.T + bias`; with a packed copy (`key`), rows >= 2 run on it."""
    if key is None or x.shape[0] == 1:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return packed_linear(x, bias, key, weight.shape[0])
    ctx = current_context()
    if ctx is None or ctx.packed is None:  # a forward outside ModelRunner's step
        return F.linear(x, weight, bias)
    return packed_mm(x, ctx.packed[key], bias)


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, bias: torch.Tensor | None, key: int,
                  out_features: int) -> torch.Tensor:
    ctx = current_context()
    if ctx is None or ctx.packed is None:
        raise RuntimeError("pdserve::packed_linear called outside ModelRunner's step context")
    return packed_mm(x, ctx.packed[key], bias)


@packed_linear.register_fake
def _(x: torch.Tensor, bias: torch.Tensor | None, key: int, out_features: int
      ) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))
