"""Projection GEMMs on oneDNN-packed weights, for CPU fp32 steps of any row count.

Measured on the development machine (AMD EPYC, AVX-512, MKL and oneDNN of torch 2.13, one
thread, SmolLM2's 30 layers of projections, weights streamed from memory):

    rows          1     2     4    16    64   512
    MKL (ms)    28.1  39.7  55.1  79.8   182  1191   (x @ W, W stored [K, N])
    oneDNN (ms) 31.6  37.6  26.5  44.6   137  1012   (W packed once, hint 16 rows)

MKL repacks the weight on every call of a small-M GEMM; a weight packed once by oneDNN
streams at about the speed of one GEMV for up to ~8 rows, and 2..3 rows are padded to 4
(cheaper than their own oneDNN kernels). With two threads (the deployment's setting) the
single row is faster on the packed weight too: SmolLM2's batch-1 projections and logits
take 23.8-26.2 ms packed against 30.1-32.2 ms on MKL's GEMV (interleaved medians, 0.54 GB
of weights: 20-27 GB/s against 12-26 GB/s), so every row count reads the packed copy. The
copies cost one more copy of the projection weights in memory; they are read instead of
the originals, so bytes per step do not grow.

Packed tensors are opaque to `torch.compile`: a compiled forward calls the op
`pdserve::packed_linear`, which takes the packed weight by key from the step context
(engine/compile_ops.py), as attention takes the KV caches. The eager forward reads the
packed tensor straight from its `Packed` handle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.compile_ops import current_context

PACK_HINT = 16  # rows oneDNN chooses its blocked layout for (best over 1..512, above)
MIN_ROWS = 4  # 2..3 rows are padded to this


@dataclass(frozen=True)
class Packed:
    """A projection's packed copy: `weight` for the eager forward, `key` (its index in
    the model's list) for a compiled one, whose graph names weights by position."""

    key: int
    weight: torch.Tensor


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a `[N, K]` weight (any strides)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT)


def pack_model(model) -> None:
    """oneDNN-packed copies of every projection weight of a Llama-family model (after its
    `fuse`; CPU fp32): every GEMM and GEMV reads them. `model.packed` lists them by key,
    the names a compiled graph's ops use."""
    model.packed = []

    def add(weight: torch.Tensor) -> Packed:
        model.packed.append(pack(weight))
        return Packed(len(model.packed) - 1, model.packed[-1])

    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv_packed, a.o_packed = add(a.qkv_weight), add(a.o_proj.weight)
        m.gate_up_packed, m.down_packed = add(m.gate_up_weight), add(m.down_proj.weight)
    model.lm_head_packed = add(model.lm_head.weight)


def packed_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """`x @ W.T + bias` for x `[M, K]` on the packed W."""
    m = x.shape[0]
    if 1 < m < MIN_ROWS:
        x = torch.cat((x, x.new_zeros(MIN_ROWS - m, x.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: Packed | None) -> torch.Tensor:
    """`x @ weight.T + bias`, on the packed copy where there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return packed_linear(x, bias, packed.key, weight.shape[0])
    return packed_mm(x, packed.weight, bias)


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
