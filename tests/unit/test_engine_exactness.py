"""Greedy output of engine.LLM == transformers generate (fp32, CPU), over chunk/block matrix."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@functools.lru_cache(maxsize=4)
def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = _hf(str(model_dir)).generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 2000, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_matches_transformers(model_dirs, arch, chunk):
    d = model_dirs[arch]
    llm = LLM(str(d), block_size=16, max_prefill_chunk=chunk, max_num_batched_tokens=64)
    # shorter than, equal to, one longer than, and several times the chunk size
    lengths = sorted({max(1, chunk - 1), chunk, chunk + 1, 3 * chunk + 5})
    prompts = [prompt(n, seed=n) for n in lengths]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(d, p, GREEDY.max_tokens), f"prompt len {len(p)}"
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_block_sizes_match_transformers(tiny_model, block_size):
    llm = LLM(str(tiny_model), block_size=block_size, max_prefill_chunk=13)
    p = prompt(45, seed=3)
    assert llm.generate([p], GREEDY)[0].token_ids == hf_greedy(tiny_model, p, 10)


def test_eight_requests_batched_together(tiny_model):
    llm = LLM(str(tiny_model), block_size=16, max_prefill_chunk=16, max_num_batched_tokens=48)
    prompts = [prompt(n, seed=n) for n in (5, 12, 16, 17, 30, 33, 64, 90)]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, 10)
    assert llm.num_steps < 8 * 10 + 20  # really batched, not one request after another
    llm.block_manager.check_integrity()
    assert llm.block_manager.num_used_blocks == 0


def test_prefix_hit_then_chunked_suffix(tiny_model):
    llm = LLM(str(tiny_model), block_size=16, max_prefill_chunk=7)
    shared = prompt(48, seed=11)
    first = shared + prompt(5, seed=12)
    second = shared + prompt(21, seed=13)
    assert llm.generate([first], GREEDY)[0].token_ids == hf_greedy(tiny_model, first, 10)
    hits = llm.block_manager.prefix_hits
    req = llm.add_request(second, GREEDY)
    llm.step()
    assert req.prefix_hit_tokens == 48
    while llm.has_unfinished():
        llm.step()
    assert req.output_token_ids == hf_greedy(tiny_model, second, 10)
    assert llm.block_manager.prefix_hits == hits + 1
    llm.block_manager.check_integrity()


def test_last_position_logits_close_to_transformers(tiny_model):
    """Tolerance: max |diff| <= 1e-4 on fp32 logits (observed ~1e-6)."""
    llm = LLM(str(tiny_model), block_size=16, max_prefill_chunk=5)
    p = prompt(23, seed=5)
    req = llm.add_request(p, GREEDY)
    captured = {}
    run = llm.runner.run  # the runner's one entry point (execute() wraps it)

    def spy(chunks):
        step = run(chunks)
        if step.sample_ids:
            captured.setdefault("logits",
                                step.logits[step.sample_ids.index(req.request_id)].clone())
        return step

    llm.runner.run = spy
    while "logits" not in captured:
        llm.step()
    ref = _hf(str(tiny_model))(torch.tensor([p])).logits[0, -1]
    assert torch.allclose(captured["logits"], ref, atol=1e-4, rtol=0)
    llm.abort(req.request_id)


def test_seed_example_3_3_2_split(tiny_model):
    """8 prompt tokens in chunks 3/3/2: same output, every layer's cache holds 8 positions."""
    p = prompt(8, seed=8)
    whole = LLM(str(tiny_model), block_size=4, max_prefill_chunk=8)
    split = LLM(str(tiny_model), block_size=4, max_prefill_chunk=3)
    req = split.add_request(p, SamplingParams(temperature=0, max_tokens=1))
    chunks = []
    while split.has_unfinished():
        out = split.scheduler.schedule()
        chunks += [i.num_tokens for i in out.items]
        ids, logits = split.runner.execute(out.chunks())
        if len(chunks) == 3:  # read the cache before the finished request frees its blocks
            kv = split.runner.kv.export_tokens(list(req.block_ids), 0, 8)
        split.scheduler.update(out, {ids[0]: int(logits[0].argmax())} if ids else {})
    assert chunks == [3, 3, 2]
    assert kv.shape[:3] == (whole.config.model.num_layers, 2, 8)
    assert kv.abs().sum(dim=(1, 3, 4)).gt(0).all()  # all 8 positions written in every layer
    ref = whole.generate([p], SamplingParams(temperature=0, max_tokens=1))[0].token_ids
    assert req.output_token_ids == ref
