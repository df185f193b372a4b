"""Projection GEMMs on oneDNN-packed weights, for CPU fp32 steps of any row count.

Measured on the development machine (AMD EPYC, AVX-512, MKL and oneDNN of torch 2.13, one
thread, SmolLM2's 30 layers of projections, weights streamed from memory):

    rows          1     2     4    16    64   512
    MKL (ms)    28.1  39.7  55.1  79.8   182  1191   (x @ W, W stored [K, N])
    oneDNN (ms) 31.6  37.6  26.5  44.6   137  1012   (W packed once, hint 16 rows)

MKL repacks the weight on every call of a small-M GEMM; a weight packed once by oneDNN
streams at about the speed of one GEMV for up to ~8 rows, and 1..3 rows are padded to 4
(cheaper than their own oneDNN kernels; and oneDNN's 1-row kernel gives a row other bits
than its kernels for 2+ rows on some shapes, SmolLM2's down projection among them). With two threads (the deployment's setting) the
single row is faster on the packed weight too: SmolLM2's batch-1 projections and logits
take 23.8-26.2 ms packed against 30.1-32.2 ms on MKL's GEMV (interleaved medians, 0.54 GB
of weights: 20-27 GB/s against 12-26 GB/s), so every row count reads the packed copy. The
copies cost one more copy of the projection weights in memory; they are read instead of
the originals, so bytes per step do not grow.

Packed tensors are opaque to `torch.compile`: a compiled forward calls the op
`pdserve::packed_linear`, which takes the packed weight by key from the step context
(engine/compile_ops.py), as attention takes the KV caches. The eager forward reads the
packed tensor straight from its `Packed` handle.

Where the `pdserve_cpu` library is loaded (the "cpu" attention backend, fp32, eager),
`add_row_blocks` gives each projection a second copy in the library's row-block layout,
and every row of every step is multiplied by its GEMM, which gives a row the same bits
at any row count (engine/models/cpu_step.cpp): a sequence's tokens do not depend on what
it was batched with (a P/D decode worker at batch 1, or colocated beside prompt chunks).
oneDNN gives a row other bits at 1 row than at 2+ for some shapes (SmolLM2's down
projection). One thread, CPU time, SmolLM2's 121 weights (`python -m tools.gemm_rows`):
the row-block GEMM takes 0.59x oneDNN's time at 1 row, 0.84x at 16, 0.95x at 64, 1.00x
at 256 and 512; at two threads under load oneDNN's GEMMs collapse (several-fold) and the
row-block GEMM's do not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.compile_ops import current_context

PACK_HINT = 16  # rows oneDNN chooses its blocked layout for (best over 1..512, above)
MIN_ROWS = 4  # 1..3 rows are padded to this


@dataclass(frozen=True)
class Packed:
    """A projection's packed copy: `weight` for the eager forward, `key` (its index in
    the model's list) for a compiled one, whose graph names weights by position."""

    key: int
    weight: torch.Tensor | None  # None once drop_onednn freed it (rows serve every row)
    rows: torch.Tensor | None = None  # the row-block copy every row reads (add_row_blocks)


def fuse_params(linears: tuple[nn.Linear, ...], name: str) -> torch.Tensor:
    """Concatenate the `name` parameters of `linears` along dim 0 and re-point each one
    at its slice of the result (a view: no second copy of the weights is kept).

    A fused weight `[N, K]` is stored transposed (`[K, N]` contiguous, seen through
    `.t()`), so `F.linear` runs a plain `x @ W_t` GEMM: on CPU BLAS this skips the
    per-call repacking of the transposed operand that makes small-batch (decode) GEMMs
    cost several times a GEMV.
    """
    fused = torch.cat([getattr(m, name).detach() for m in linears])
    if fused.dim() == 2:
        fused = fused.t().contiguous().t()
    start = 0
    for m in linears:
        n = getattr(m, name).shape[0]
        setattr(m, name, nn.Parameter(fused[start : start + n], requires_grad=False))
        start += n
    return fused


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


def _repack(model, fn) -> None:
    """Replace every projection's `Packed` handle p by `fn(p, its weight)`."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv_packed, a.o_packed = fn(a.qkv_packed, a.qkv_weight), fn(a.o_packed, a.o_proj.weight)
        m.gate_up_packed = fn(m.gate_up_packed, m.gate_up_weight)
        m.down_packed = fn(m.down_packed, m.down_proj.weight)
    model.lm_head_packed = fn(model.lm_head_packed, model.lm_head.weight)


def add_row_blocks(model) -> None:
    """A row-block copy (`pdserve_cpu::pack_rows`) beside every oneDNN-packed projection
    of a packed model; the library must be loaded."""
    pack_rows = torch.ops.pdserve_cpu.pack_rows
    _repack(model, lambda p, weight: replace(p, rows=pack_rows(weight)))


def drop_onednn(model) -> None:
    """Free oneDNN's copies of a model whose row-block copies serve every row: eager steps
    never read them (a compiled step reads them by key: a compiling runner keeps them)."""
    _repack(model, lambda p, weight: replace(p, weight=None))
    model.packed = None


def packed_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """`x @ W.T + bias` for x `[M, K]` on the packed W."""
    m = x.shape[0]
    if m < MIN_ROWS:
        x = torch.cat((x, x.new_zeros(MIN_ROWS - m, x.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: Packed | None) -> torch.Tensor:
    """`x @ weight.T + bias`, on the row-block copy where there is one, else the packed
    copy where there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return packed_linear(x, bias, packed.key, weight.shape[0])
    if packed.rows is not None:
        return torch.ops.pdserve_cpu.gemv(x, packed.rows, bias, weight.shape[0])
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
