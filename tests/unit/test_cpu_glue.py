"""The Llama layer's glue as single CPU ops (engine/models/cpu_glue.cpp): the residual add
is exact, RMSNorm agrees with `F.rms_norm` to float rounding, rotary is bit-equal to the
four-op `_rope` (itself bit-equal to transformers'); a CPU engine on the "cpu" backend
runs its layers through them and its greedy output is transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.attention import cpu_build, get_backend
from engine.models.llama import _rope
from tests.unit.test_engine_exactness import hf_greedy, prompt


@pytest.fixture(scope="module")
def ops():
    if get_backend("cpu", "cpu").name != "cpu":
        pytest.skip(f"CPU ops unavailable: {cpu_build.load()}")
    return torch.ops.pdserve_cpu


@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_add_rms_norm_is_the_exact_sum_and_its_norm(ops, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    wide = 3 * torch.randn(rows, hidden + 8, generator=g)
    x = wide[:, :hidden]  # strided rows, as a slice of a fused projection's output is
    d, w = torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g)
    total, normed = ops.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(total, x + d)
    torch.testing.assert_close(normed, F.rms_norm(x + d, (hidden,), w, 1e-5),
                               rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (hidden,), w, 1e-6),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(("rows", "heads", "dim"), [(1, 12, 64), (5, 3, 16), (40, 7, 128)])
def test_rope_op_is_bit_equal_to_the_four_op_rope(ops, rows, heads, dim):
    g = torch.Generator().manual_seed(heads)
    qkv = 4 * torch.randn(rows, heads + 2, dim, generator=g)
    x = qkv[:, :heads]  # the q and k heads of a fused qkv: strided rows
    pos = torch.randint(0, 8192, (rows,), generator=g).float()
    freqs = pos[:, None] * 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [T, 1, D]
    cos, sin = emb.cos(), emb.sin()
    sin[..., : dim // 2].neg_()
    assert torch.equal(ops.rope(x, cos, sin), _rope(x, cos, sin))


def test_the_engine_runs_its_layers_on_the_glue_and_matches_transformers(ops, tiny_model):
    llm = LLM(str(tiny_model), block_size=4, max_prefill_chunk=7, compile="none")
    assert llm.runner.backend.name == "cpu" and llm.runner.model.cpu_glue
    calls = []
    real = llm.runner.model._forward_glued

    def counting(*a):
        calls.append(a[0].shape[0])
        return real(*a)

    llm.runner.model._forward_glued = counting
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [prompt(n, seed=n) for n in (2, 9, 23)]
    for p, o in zip(prompts, llm.generate(prompts, sp), strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, sp.max_tokens)
    assert calls and llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


def test_the_torch_backend_keeps_the_reference_layers(tiny_model):
    llm = LLM(str(tiny_model), attention_backend="torch", compile="none")
    assert not llm.runner.model.cpu_glue
