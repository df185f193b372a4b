"""A decode step's decoder stack as one compiled CPU call (fp32; issue 16).

At batch 1 a SmolLM2 step must read its 0.54 GB of weights once; on 2 cores the eager
layer loop spent ~25 ms in oneDNN's packed GEMVs (about 22 GB/s) and ~8 ms more in the
~20 torch ops and the Python of each of its 30 layers. `pdserve_cpu::decode_layers`
(engine/models/cpu_step.cpp) runs every layer in C++ on weights packed once more as
blocks of 16 output rows read as one sequential stream (`pack_rows`), which streams at
the rate of a plain read of the same bytes: the step costs the weights' walk plus one
op call. The lm_head of a few rows reads its packed copy the same way (`gemv`).

Measured on the shared 2-core development machine (SmolLM2, 2 threads, interleaved
medians): the batch-1 step took 24.1 ms fused against 32.9 ms in the layer loop (load
2.4); the projections alone (all 121 weights) 30.0 ms on the row-block GEMV against 32.2
ms on oneDNN's at 1 row, but 66 against 33 ms at 16 rows on a quiet machine, while under
load (5-10 on 2 cores) oneDNN's multi-row GEMMs collapsed (decode steps of 4..16 rows:
470-1470 ms, against 98-230 ms on the GEMV). Up to `GEMV_ROWS` rows the stack reads the
row-block copies; wider batches multiply oneDNN's packed copies from inside the same call.

The stack serves decode-only batches of up to `FUSED_ROWS` rows; wider batches and any
prefill run the layer loop of engine/models/llama.py on oneDNN's packed GEMMs, the
reference it is tested against (greedy equal to transformers). It exists only where the
`pdserve_cpu` library loaded (the "cpu" attention backend); where the build fails the
backend falls back to torch, with the reason logged, and no stack is made.

The packed copies cost one more copy of the projection weights and the lm_head in
memory (they are read instead of the oneDNN copies in these steps, so bytes per step do
not grow).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.attention.base import AttentionMetadata

FUSED_ROWS = 256  # decode batches up to this many rows take the fused stack
# Up to this many rows read the row-block copy (faster at 1 row than oneDNN's GEMV on
# this machine's 2 cores, slower from ~4); more: oneDNN's packed copies, the layer loop's
# own. 0: oneDNN for every row, so a decode row's bits never depend on whether its step
# also ran a prefill chunk (colocated) or not (P/D), and no second copy of the weights.
GEMV_ROWS = 0


class CpuDecodeStack:
    """Every layer's norms, packed weights and biases, flattened once into the lists
    `decode_layers` takes (4 weights and 4 biases a layer; 2 norms, 4 with q/k norms)."""

    def __init__(self, model: torch.nn.Module):  # a fused engine.models.llama model
        cfg, ops = model.cfg, torch.ops.pdserve_cpu
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            if a.qkv_weight is None or m.gate_up_weight is None:
                raise ValueError("the fused CPU stack needs the model's fused projections "
                                 "(call model.fuse() first)")
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if cfg.qk_norm:
                self.norms += [a.q_norm.weight, a.k_norm.weight]
            if GEMV_ROWS > 0 or not model.packed:  # (else oneDNN's copies serve every row)
                self.weights += [ops.pack_rows(w) for w in (
                    a.qkv_weight, a.o_proj.weight, m.gate_up_weight, m.down_proj.weight)]
            self.biases += [a.qkv_bias, a.o_proj.bias, m.gate_up_bias, m.down_proj.bias]
        self.lm_head = ops.pack_rows(model.lm_head.weight) if GEMV_ROWS > 0 else None
        self.onednn = list(model.packed[:4 * len(model.model.layers)]) if model.packed else []
        self.dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                     int(cfg.qk_norm)]
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim**-0.5

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the last layer `[T, hidden]` (before the final
        norm), as the layer loop returns it; the step's K/V are written to the caches."""
        return torch.ops.pdserve_cpu.decode_layers(
            x, cos, sin, self.norms, self.weights, self.biases, self.onednn, k_caches,
            v_caches, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
            self.dims, self.eps, self.scale, GEMV_ROWS)
