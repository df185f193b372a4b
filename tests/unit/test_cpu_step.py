"""The eager CPU step (issue 16): single-row projections read the oneDNN-packed weights,
rotary embedding in four ops is bit-equal to transformers', the torch reference works out
a step's metadata once and never reuses it for another step's tensors, and a CPU step
with compile "none" never enters engine/compile.py, compile_ops.py or device.py (issue
12's hot path)."""

from __future__ import annotations

import sys

import torch

from engine import LLM, SamplingParams
from engine.attention import torch_ref
from engine.loader import load_model_config
from engine.models import linear
from engine.models.llama import LlamaForCausalLM, _rope
from tests.unit.test_engine_exactness import hf_greedy, prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_rope_in_four_ops_is_bit_equal_to_transformers(tiny_model):
    from transformers.models.llama.modeling_llama import rotate_half

    cfg = load_model_config(tiny_model)
    model = LlamaForCausalLM(cfg)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    cos, sin_signed = model.rope(positions, torch.float32)  # [T, 1, D]
    freqs = positions.float()[:, None] * model.inv_freq(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    sin = emb.sin() * cfg.rope_attention_scaling
    assert torch.equal(cos, emb.cos() * cfg.rope_attention_scaling)
    x = 5 * torch.randn(5, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim,
                        generator=torch.Generator().manual_seed(0))
    assert torch.equal(_rope(x, cos, sin_signed), x * cos + rotate_half(x) * sin)


def test_single_row_projections_read_the_packed_weights(tiny_model, monkeypatch):
    # the torch backend: no pdserve_cpu library, so no row-block copies for decode rows
    # (those are test_cpu_fused_step's); oneDNN's packed copies serve every row count
    llm = LLM(str(tiny_model), compile="none", attention_backend="torch")
    model = llm.runner.model
    assert model.packed and model.lm_head_packed is not None
    assert model.cpu_stack is None and model.lm_head_packed.rows is None
    rows: list[int] = []
    packed_mm = linear.packed_mm

    def counting(x, packed, bias):
        rows.append(x.shape[0])
        return packed_mm(x, packed, bias)

    monkeypatch.setattr(linear, "packed_mm", counting)
    p = prompt(9, seed=3)
    assert llm.generate([p], GREEDY)[0].token_ids == hf_greedy(tiny_model, p,
                                                               GREEDY.max_tokens)
    per_step = 4 * model.cfg.num_layers + 1  # qkv, o, gate_up, down; lm_head
    # the prefill's one logits row, then a decode step for each later token
    assert rows.count(1) == 1 + per_step * (GREEDY.max_tokens - 1)
    x = torch.randn(1, model.cfg.hidden_size)
    a = model.model.layers[0].self_attn
    torch.testing.assert_close(linear.project(x, a.qkv_weight, a.qkv_bias, a.qkv_packed),
                               torch.nn.functional.linear(x, a.qkv_weight, a.qkv_bias))
    assert llm.block_manager.num_used_blocks == 0


def _reference(q, k_cache, v_cache, table, n):
    """One sequence's decode attention over its `n` keys, from the cache's slots."""
    bs = k_cache.shape[1]
    slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
    flat = (-1, k_cache.shape[2], k_cache.shape[3])
    return torch_ref._attend_batch(q[None], k_cache.reshape(flat)[slots][None],
                                   v_cache.reshape(flat)[slots][None], 0.125, None)[0]


def test_a_steps_decode_plan_serves_its_layers_and_never_another_step():
    g = torch.Generator().manual_seed(1)
    layers = [(torch.randn(12, 4, 2, 8, generator=g), torch.randn(12, 4, 2, 8, generator=g))
              for _ in range(2)]
    tables = torch.tensor([[3, 7, 1], [0, 5, 11]], dtype=torch.int32)
    q = torch.randn(2, 6, 8, generator=g)
    for lens in ([9, 4], [2, 12], [12, 12]):  # each a new step: new metadata tensors
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        for kc, vc in layers:  # one step's layers share its tensors (and its plan)
            out = torch_ref.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
            for s, n in enumerate(lens):
                torch.testing.assert_close(
                    out[s:s + 1], _reference(q[s:s + 1], kc, vc, tables[s].tolist(), n))


def test_a_cpu_eager_step_never_enters_the_compile_or_device_modules(tiny_model):
    llm = LLM(str(tiny_model), compile="none")
    llm.generate([prompt(5, seed=1)], GREEDY)  # first-use setup off the record
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    p = prompt(21, seed=4)
    sys.setprofile(profile)
    try:
        out = llm.generate([p], GREEDY)[0]
    finally:
        sys.setprofile(None)
    assert out.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens)
    names = {f.replace("\\", "/") for f in seen}
    assert any(f.endswith("engine/models/llama.py") for f in names)  # the recording works
    for module in ("engine/compile.py", "engine/compile_ops.py", "engine/device.py"):
        assert not any(f.endswith(module) for f in names), f"{module} on the CPU step"
    assert llm.block_manager.num_used_blocks == 0
