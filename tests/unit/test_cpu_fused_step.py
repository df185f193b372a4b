"""The fused CPU decode stack (engine/models/cpu_step.py, cpu_step.cpp): its GEMV on the
row-block packed weights is `F.linear` to float rounding and gives a row the same bits
whatever it is batched with; the whole stack's step equals the layer loop's; and engines
whose decode steps run through it (checked: the stack is called, not bypassed) produce
transformers' greedy tokens over the chunk x block matrix, for llama, qwen2 (biases) and
qwen3 (q/k norms), and on SmolLM2's real weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.attention import cpu_build, get_backend
from engine.models import cpu_step
from tests.unit.test_engine_exactness import hf_greedy, prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ops():
    if get_backend("cpu", "cpu").name != "cpu":
        pytest.skip(f"CPU ops unavailable: {cpu_build.load()}")
    return torch.ops.pdserve_cpu


@pytest.fixture
def stack_calls(ops, monkeypatch) -> list[int]:
    """Rows of every fused-stack call (the stack itself still runs)."""
    calls: list[int] = []
    real = cpu_step.CpuDecodeStack.__call__

    def counting(self, x, *a):
        calls.append(x.shape[0])
        return real(self, x, *a)

    monkeypatch.setattr(cpu_step.CpuDecodeStack, "__call__", counting)
    return calls


@pytest.mark.parametrize(("n", "k"), [(16, 64), (37, 19), (960, 576), (5, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_is_linear_and_a_row_does_not_depend_on_its_batch(ops, n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = ops.pack_rows(w)
    assert packed.shape == (-(-n // 64), k, 64)
    x = torch.randn(14, k, generator=g)
    alone = torch.cat([ops.gemv(x[r:r + 1], packed, b, n) for r in range(14)])
    for m in (1, 2, 5, 6, 7, 13, 14):  # one register tile, several, and k in pieces
        y = ops.gemv(x[:m], packed, b, n)
        torch.testing.assert_close(y, F.linear(x[:m], w, b), rtol=1e-5, atol=1e-4)
        assert torch.equal(y, alone[:m])  # in a tile of six or alone: the same bits


def test_gemv_rejects_a_weight_not_packed_for_its_input(ops):
    packed = ops.pack_rows(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="pack_rows weight"):
        ops.gemv(torch.randn(1, 63), packed, None, 32)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_fused_step_equals_the_layer_loops(ops, model_dirs, arch, stack_calls):
    """Same prompt, a few decode steps each way: the same hidden states, bit for bit (the
    same kernels on the same rows), and the caches receive the same K/V rows."""
    # no prefix cache: the second run must prefill the same rows as the first
    llm = LLM(str(model_dirs[arch]), block_size=4, compile="none", enable_prefix_caching=False)
    model = llm.runner.model
    assert model.cpu_stack is not None
    captured: dict[str, list[torch.Tensor]] = {"fused": [], "loop": []}
    real_logits = model.compute_logits

    def logits(hidden, key):
        captured[key].append(hidden.clone())
        return real_logits(hidden)

    stack = model.cpu_stack
    p = prompt(13, seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for key in ("fused", "loop"):
        model.cpu_stack = stack if key == "fused" else None
        model.compute_logits = lambda h, d=0, key=key: logits(h, key)
        llm.generate([p], sp)
    assert stack_calls == [1] * 3  # the three decode steps of the fused run
    for a, b in zip(captured["fused"], captured["loop"], strict=True):
        assert torch.equal(a, b), (a - b).abs().max()  # the same kernels: the same bits
    assert llm.block_manager.num_used_blocks == 0
    empty = model.compute_logits(torch.zeros(0, model.cfg.hidden_size))  # a prefill step
    assert empty.shape == (0, model.cfg.vocab_size)  # that finished no prompt samples none


@pytest.mark.parametrize(("arch", "block_size", "chunk"), [
    ("llama", 1, 5), ("llama", 4, 3), ("llama", 16, 16), ("llama", 32, 7),
    ("qwen2", 4, 3), ("qwen3", 16, 7)])  # the matrix on one, each variant once more
def test_greedy_through_the_fused_stack_equals_transformers(model_dirs, arch, block_size,
                                                           chunk, stack_calls):
    d = model_dirs[arch]
    llm = LLM(str(d), block_size=block_size, max_prefill_chunk=chunk,
              max_num_batched_tokens=40, compile="none")
    prompts = [prompt(n, seed=n) for n in (1, 6, 17, 33)]
    for p, o in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(d, p, GREEDY.max_tokens)
    assert stack_calls and max(stack_calls) <= cpu_step.FUSED_ROWS
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


def test_a_batch_wider_than_the_stack_runs_the_layer_loop(ops, tiny_model, stack_calls,
                                                          monkeypatch):
    monkeypatch.setattr("engine.models.llama.FUSED_ROWS", 2)
    llm = LLM(str(tiny_model), compile="none")
    prompts = [prompt(n, seed=n) for n in (3, 5, 8)]
    for p, o in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens)
    assert stack_calls == []  # one prefill step, then 3-row decodes: all on the loop
    assert llm.block_manager.num_used_blocks == 0


def _decode_logprobs(llm: LLM, others: list[list[int]], chunk_others: bool) -> list:
    """Sequence A's per-token log-probs (top 5, as floats) when its prompt was prefilled
    alone and `others` join once it decodes (their prompt chunks beside its decode rows)."""
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    a = llm.add_request(prompt(11, seed=3), sp)
    while not a.output_token_ids:
        llm.step()
    for p in others:
        llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while llm.has_unfinished():
        llm.step()
    assert llm.block_manager.num_used_blocks == 0
    return [(t.token_id, t.logprob, t.top) for t in a.output_logprobs]


def _smollm2():
    from engine.model_fetch import ModelFetchError, ensure_real_model

    try:
        return ensure_real_model("smollm2")
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2 real weights unavailable: {e}")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "smollm2"])
def test_a_decode_rows_numbers_do_not_depend_on_its_batch(ops, model_dirs, arch, stack_calls):
    """Batch invariance (what makes P/D and colocated serving agree): a decoding sequence's
    log-probs are the same floats alone, beside four other decodes (the fused stack at 5
    rows) and beside their prompt chunks (mixed steps: the layer loop). On SmolLM2's real
    weights oneDNN alone fails this (9 of 10 log-probs differed: its down projection
    gives a row other bits at 1 row than at 2+); the tiny models' shapes do not show it."""
    d = _smollm2() if arch == "smollm2" else model_dirs[arch]
    llm = LLM(str(d), block_size=4, max_prefill_chunk=6, num_blocks=128,  # A's prompt: the
              max_num_batched_tokens=16, compile="none", enable_prefix_caching=False)  # same rows
    model = llm.runner.model  # eager: the row-block copies serve every row, oneDNN's freed
    assert model.packed is None and model.lm_head_packed.weight is None
    assert model.lm_head_packed.rows is not None
    alone = _decode_logprobs(llm, [], False)
    assert stack_calls and max(stack_calls) == 1
    stack_calls.clear()
    others = [prompt(n, seed=10 + n) for n in (7, 13, 20, 26)]
    batched = _decode_logprobs(llm, others, True)
    assert max(stack_calls) >= 4  # decode-only steps beside the others ran the stack
    assert len(batched) == len(alone) == 10
    assert batched == alone
    llm.block_manager.check_integrity()


def test_smollm2_decodes_through_the_fused_stack_as_transformers(ops, stack_calls):
    d = _smollm2()
    llm = LLM(str(d), block_size=8, max_prefill_chunk=37, num_blocks=64, compile="none")
    prompts = [prompt(n, seed=n) for n in (5, 70)]
    for p, o in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(d, p, GREEDY.max_tokens)
    assert stack_calls and llm.block_manager.num_used_blocks == 0
