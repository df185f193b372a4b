"""Issue 37, item 2: the compiled shapes built at start-up are the ones serving runs. The
warm-up ran its padding steps with grad mode on while serving runs under inference mode;
dynamo guards on the grad mode, so the first real decode step re-traced every shape (on
CUDA: re-recorded every graph). Checked with dynamo's own counters, with the CUDA-graph
layout (decode batches padded to buckets) on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine import compile as compile_mod
from tests.unit.test_engine_exactness import hf_greedy, prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def padded_llm(tiny_model):
    mp = pytest.MonkeyPatch()
    mp.setattr(compile_mod, "PADDED_DECODE", {"cpu", "cuda"})
    try:
        yield LLM(str(tiny_model), compile="decode", max_num_seqs=4, block_size=4,
                  max_prefill_chunk=64)
    finally:
        mp.undo()


def test_first_real_steps_after_warmup_compile_nothing(padded_llm, tiny_model):
    from torch._dynamo.utils import counters

    llm = padded_llm
    assert llm.runner.compiled.mode == "decode", llm.runner.compiled.report.line()
    assert llm.runner.compiled.report.graphs == ["decode T=1", "decode T=2", "decode T=4"]
    graphs, frames = counters["stats"]["unique_graphs"], dict(counters["frames"])
    assert not torch.is_inference_mode_enabled()  # the caller's mode: serving sets its own
    prompts = [prompt(n, seed=n) for n in (3, 6, 11)]  # 3 decodes pad to 4; then 2, 1
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens)
    assert counters["stats"]["unique_graphs"] == graphs  # no shape was traced again
    assert dict(counters["frames"]) == frames
    assert llm.runner.compiled.mode == "decode"
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()
