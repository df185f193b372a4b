"""A decode step's decoder stack as one compiled CPU call (fp32; issue 16).

At batch 1 a SmolLM2 step must read its 0.54 GB of weights once; on 2 cores the eager
layer loop spent ~25 ms in oneDNN's packed GEMVs (about 22 GB/s) and ~8 ms more in the
~20 torch ops and the Python of each of its 30 layers. `pdserve_cpu::decode_layers`
(engine/models/cpu_step.cpp) runs every layer in C++ on the projections' row-block
copies (blocks of 64 outputs read as one sequential stream, models/linear.py
`add_row_blocks`): the step costs the weights' walk plus one op call.

Its GEMM is batch-invariant (every output one multiply-add chain over k in order, at any
row count), and the layer loop multiplies every row of the other steps by the same
kernel, so a row gets the same bits alone, beside other decodes, or beside a prompt
chunk: P/D and colocated serving compute a sequence's tokens alike. Measured on the
2-core development machine (SmolLM2's 121 weights, one thread, CPU time, oneDNN's packed
GEMMs beside it): 0.59x oneDNN's time at 1 row, 0.84x at 16, 0.95x at 64, 1.00x at 256
and 512 (`python -m tools.gemm_rows`).

The stack serves decode-only batches of up to `FUSED_ROWS` rows; wider batches and any
prefill run the layer loop of engine/models/llama.py, the reference it is tested against
(greedy equal to transformers). It exists only where the `pdserve_cpu` library loaded
(the "cpu" attention backend); where the build fails the backend falls back to torch,
with the reason logged, and no stack is made.

The row-block copies cost one more copy of the projection weights and the lm_head in
memory (steps read them instead of oneDNN's, so bytes per step do not grow; oneDNN's
copies stay for compiled steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.attention.base import AttentionMetadata

FUSED_ROWS = 256  # decode batches up to this many rows take the fused stack


class CpuDecodeStack:
    """Every layer's norms, row-block weights and biases, flattened once into the lists
    `decode_layers` takes (4 weights and 4 biases a layer; 2 norms, 4 with q/k norms)."""

    def __init__(self, model: torch.nn.Module):  # engine.models.llama, after add_row_blocks
        cfg = model.cfg
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            packed = (a.qkv_packed, a.o_packed, m.gate_up_packed, m.down_packed)
            if any(p is None or p.rows is None for p in packed):
                raise ValueError("the fused CPU stack needs the model's row-block copies "
                                 "(fuse(), pack(), then add_row_blocks)")
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if cfg.qk_norm:
                self.norms += [a.q_norm.weight, a.k_norm.weight]
            self.weights += [p.rows for p in packed]
            self.biases += [a.qkv_bias, a.o_proj.bias, m.gate_up_bias, m.down_proj.bias]
        self.dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                     int(cfg.qk_norm)]
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim**-0.5

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the last layer `[T, hidden]` (before the final
        norm), as the layer loop returns it; the step's K/V are written to the caches."""
        return torch.ops.pdserve_cpu.decode_layers(
            x, cos, sin, self.norms, self.weights, self.biases, k_caches, v_caches,
            meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens, self.dims,
            self.eps, self.scale)
