"""The compiled decode step on CUDA (CUDA graphs per batch bucket): greedy output equals
the eager engine's and transformers' (fp32), batches that pad to a bucket included, and
every bucket is recorded at start-up."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 2000, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 90, (n,), generator=g)]


@pytest.mark.parametrize("batch", [1, 3, 5, 17])  # 3, 5 and 17 pad to buckets 4, 8 and 24
def test_cuda_graph_decode_equals_eager(tiny_model, batch):
    outs = {}
    for mode in ("none", "decode"):
        llm = LLM(str(tiny_model), device="cuda", dtype="float32", compile=mode,
                  max_num_seqs=32, max_prefill_chunk=16)
        rep = llm.runner.compiled.report
        assert rep.mode == mode, rep.line()
        if mode == "decode":
            assert len(rep.graphs) == len(llm.runner.compiled.buckets)
        outs[mode] = [o.token_ids for o in llm.generate(prompts(batch), GREEDY)]
        assert llm.runner.compiled.mode == mode  # no fallback while serving
        assert llm.block_manager.num_used_blocks == 0
    assert outs["decode"] == outs["none"]


def test_cuda_graph_decode_matches_transformers(tiny_model):
    from tests.unit.test_engine_exactness import hf_greedy

    llm = LLM(str(tiny_model), device="cuda", dtype="float32", compile="all",
              max_prefill_chunk=7)
    ps = prompts(3)
    for p, o in zip(ps, llm.generate(ps, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens)
    assert llm.runner.compiled.mode == "all"


def test_graph_steps_retrace_nothing_and_write_only_new_table_entries(tiny_model):
    """Issue 37 items 2-4 on CUDA: after the start-up warm-up, serving traces no graph
    again (dynamo's counters), the graph steps run on the thread that recorded them, and
    the device block tables get only their changed entries."""
    from torch._dynamo.utils import counters

    llm = LLM(str(tiny_model), device="cuda", dtype="float32", compile="decode",
              max_num_seqs=8, max_prefill_chunk=16, block_size=4)
    graphs = counters["stats"]["unique_graphs"]
    tables = llm.runner._graph_tables
    outs = llm.generate(prompts(5), GREEDY)
    assert counters["stats"]["unique_graphs"] == graphs
    assert llm.runner.compiled.mode == "decode" and not llm.runner._warned_thread
    # 5 rows of 12 decode steps: their tables once, then one entry per new block
    blocks = sum(-(-(len(o.prompt_token_ids) + len(o.token_ids)) // 4) for o in outs)
    assert 0 < tables.written <= blocks
    assert llm.block_manager.num_used_blocks == 0
