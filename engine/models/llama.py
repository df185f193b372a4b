"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over flattened tokens.

A batch is a flat run of tokens from many sequences (decodes first, then prefill chunks),
no padding. Positions come from each token's global index in its sequence. Parameter
names match the HF checkpoints, so `load_state_dict` takes safetensors as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionMetadata, attend
from engine.compile_ops import paged_attention
from engine.config import ModelConfig
from engine.models.cpu_step import FUSED_ROWS, CpuDecodeStack
from engine.models.linear import Packed, add_row_blocks, fuse_params, pack_model, project


class RMSNorm(nn.Module):
    """transformers' RMSNorm as one op: `F.rms_norm` is bit-equal to its fp32 formula
    (tests/unit/test_compiled_step.py); other dtypes normalise in fp32 and round before
    the weight, as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, bit for bit, in four ops:
    rotate_half(x) = [-x2, x1], and [-x2, x1] * [s1, s2] == roll(x) * [-s1, s2] = [x2, x1] *
    [-s1, s2] (a sign flip is exact), with the signed sin made once per step."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed



def _glued_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """`norm` over the last dim of `[T, N, D]` heads by the pdserve_cpu op."""
    return torch.ops.pdserve_cpu.rms_norm(x.reshape(-1, x.shape[-1]), norm.weight,
                                          norm.eps).view(x.shape)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer  # this layer's KV cache in a compiled step's context
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        # set by fuse(); the q/k/v weights view it. Buffers, so that `.to()` moves them.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.qkv_packed: Packed | None = None  # packed copies (models/linear.py), by pack()
        self.o_packed: Packed | None = None
        self.cpu_glue = False  # rotary by the pdserve_cpu op (use_cpu_glue)

    @torch.no_grad()
    def fuse(self) -> None:
        """One `[(H + 2 KVH) * D, hidden]` GEMM instead of three; the q/k/v parameters
        become views into the fused tensor, so names and state_dict are unchanged."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = fuse_params(projs, "weight")
        if self.q_proj.bias is not None:
            self.qkv_bias = fuse_params(projs, "bias")

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim], first half negated (LlamaForCausalLM.rope)
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = project(x, self.qkv_weight, self.qkv_bias, self.qkv_packed).view(
                t, h + 2 * kvh, d)  # [T, H + 2 KVH, D]
            qk, v = qkv[:, : h + kvh], qkv[:, h + kvh :]
            glue = self.cpu_glue and not torch.compiler.is_compiling()  # the op: bit-equal
            if self.qk_norm:
                q, k = qk[:, :h], qk[:, h:]
                if glue:  # the fused stack's norm op: both paths give the same bits
                    q, k = _glued_norm(q, self.q_norm), _glued_norm(k, self.k_norm)
                qk = torch.cat((q, k) if glue else (self.q_norm(q), self.k_norm(k)), dim=1)
            qk = torch.ops.pdserve_cpu.rope(qk, cos, sin) if glue else _rope(qk, cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = self.q_proj(x).view(t, h, d)
            k = self.k_proj(x).view(t, kvh, d)
            v = self.v_proj(x).view(t, kvh, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if torch.compiler.is_compiling():  # one opaque op; caches and metadata from context
            out = paged_attention(q, k, v, self.layer, self.scale)
        else:
            out = attend(meta, q, k, v, k_cache, v_cache, self.scale)
        o = self.o_proj
        return project(out.reshape(t, self.num_heads * self.head_dim), o.weight, o.bias,
                       self.o_packed)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.register_buffer("gate_up_weight", None, persistent=False)  # set by fuse()
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.gate_up_packed: Packed | None = None
        self.down_packed: Packed | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """One `[2 * intermediate, hidden]` GEMM for gate and up (their weights view it)."""
        self.gate_up_weight = fuse_params((self.gate_proj, self.up_proj), "weight")
        if self.gate_proj.bias is not None:
            self.gate_up_bias = fuse_params((self.gate_proj, self.up_proj), "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = project(x, self.gate_up_weight, self.gate_up_bias,
                           self.gate_up_packed).chunk(2, dim=-1)
        d = self.down_proj
        return project(F.silu(gate) * up, d.weight, d.bias, self.down_packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """One class for every supported architecture; ModelConfig flags select the variant."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Rotary frequencies are not a buffer: `.to(dtype=bf16)` would round them (0.4%
        # error, radians of angle by position 4k). fp32 copies per device, made on demand.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.packed: list[torch.Tensor] | None = None  # by key; see pack()
        self.lm_head_packed: Packed | None = None
        self.cpu_glue = False  # by use_cpu_glue(), with the fused decode stack:
        self.cpu_stack: CpuDecodeStack | None = None

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Install checkpoint tensors as the parameters themselves (`assign=True`: no copy
        into pre-allocated ones, so a model built on the `meta` device is materialised
        straight from the checkpoint, in the tensors' dtype and on their device)."""
        tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(tensors, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing={missing[:5]} "
                             f"unexpected={unexpected[:5]}")
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)

    def fuse(self) -> None:
        """Fuse q/k/v and gate/up projections into single GEMMs and store every
        projection weight transposed (see models/linear.fuse_params). Call once the weights are
        final (after loading and any `.to()`); parameter names and values stay the same."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            fuse_params((layer.self_attn.o_proj,), "weight")
            fuse_params((layer.mlp.down_proj,), "weight")
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        fuse_params((self.lm_head,), "weight")
        if tied:  # the embedding reads its rows from the same, transposed, storage:
            # a strided gather of T rows costs little next to a logits GEMV at 2x speed
            self.model.embed_tokens.weight = self.lm_head.weight

    @torch.no_grad()
    def pack(self) -> None:
        """oneDNN-packed copies of every projection weight (models/linear.py)."""
        pack_model(self)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """`[head_dim / 2]` fp32 rotary inverse frequencies on `device` (as transformers)."""
        t = self._inv_freq.get(device)
        if t is None:
            t = torch.tensor(self.cfg.rope_inv_freq, dtype=torch.float32, device=device)
            self._inv_freq[device] = t
        return t

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, head_dim]` of `positions` `[T]`, sin's first half negated."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq(positions.device)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, D]
        scaling = self.cfg.rope_attention_scaling
        sin = emb.sin() * scaling
        sin[..., : sin.shape[-1] // 2].neg_()
        return (emb.cos() * scaling).to(dtype), sin.to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        k_caches: list[torch.Tensor] | None = None,
        v_caches: list[torch.Tensor] | None = None,
        meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` before the final norm (logits are taken only where
        sampled). Compiled (engine.compile), the caches and metadata are left out: the
        attention op reads them from the step context."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        if self.cpu_glue and not torch.compiler.is_compiling():
            return self._forward_glued(x, cos, sin, k_caches, v_caches, meta)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, k_caches and k_caches[i], v_caches and v_caches[i], meta)
        return x

    def use_cpu_glue(self) -> None:
        """Residual adds, RMSNorms, rotary as pdserve_cpu ops, every row on the
        batch-invariant GEMM (models/linear.py) and decode batches through the fused stack
        (engine/models/cpu_step.py); the library is loaded, fp32 on CPU, after pack()."""
        self.cpu_glue = True
        for layer in self.model.layers:
            layer.self_attn.cpu_glue = True
        add_row_blocks(self)
        self.cpu_stack = CpuDecodeStack(self)

    def _forward_glued(self, x, cos, sin, k_caches, v_caches, meta) -> torch.Tensor:
        """The layer loop with each residual add fused into the next RMSNorm (one op)."""
        if self.cpu_stack is not None and meta.num_decode_tokens == x.shape[0] <= FUSED_ROWS:
            return self.cpu_stack(x, cos, sin, k_caches, v_caches, meta)
        ops, layers = torch.ops.pdserve_cpu, self.model.layers
        h = ops.rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, layer in enumerate(layers):
            a, post = layer.self_attn(h, cos, sin, k_caches[i], v_caches[i], meta), \
                layer.post_attention_layernorm
            x, h = ops.add_rms_norm(x, a, post.weight, post.eps)
            m = layer.mlp(h)
            if i + 1 == len(layers):
                return x + m
            nxt = layers[i + 1].input_layernorm
            x, h = ops.add_rms_norm(x, m, nxt.weight, nxt.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(hidden)
        return project(h, self.lm_head.weight, None, self.lm_head_packed).float()
