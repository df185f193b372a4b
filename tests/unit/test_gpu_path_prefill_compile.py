"""Issue 37, item 7: prefill workers compile no decode step and record no CUDA graph. The
compile mode was passed to both roles, so a prefill worker on a GPU ("auto" = "decode"
there) spent start-up compiling and capturing decode graphs of every batch bucket, and
held their memory, for decode batches it never runs."""

from __future__ import annotations

import pytest
import torch

from cluster.config.serve import ServeConfig
from cluster.launch.worker_specs import engine_config
from engine import LLM, SamplingParams
from engine.compile import CompiledStep, role_mode
from engine.config import COMPILE_MODES
from tests.unit.test_engine_exactness import hf_greedy, prompt


def test_a_prefill_worker_compiles_no_decode_step_for_any_mode(tiny_model):
    assert {m: role_mode(m, "prefill") for m in COMPILE_MODES} == {
        "auto": "none", "none": "none", "decode": "none", "all": "prefill",
        "prefill": "prefill"}
    for role in ("decode", "colocated"):
        assert all(role_mode(m, role) == m for m in COMPILE_MODES)
    for mode in COMPILE_MODES:
        cfg = ServeConfig().with_values({"model.compile": mode})
        assert engine_config(cfg, str(tiny_model), "prefill").compile == role_mode(
            mode, "prefill")
        assert engine_config(cfg, str(tiny_model), "decode").compile == mode


def test_prefill_mode_on_cuda_records_no_graph_and_pads_nothing():
    """What the mode sets up on a CUDA device (nothing is compiled or run here)."""
    model = torch.nn.Linear(2, 2)
    cuda = torch.device("cuda", 0)
    step = CompiledStep(model, cuda, "prefill", max_num_seqs=256)
    assert not step.graphs and not step.padded and step.buckets == ()
    assert step.forward_for(True) is step.forward_for(False) is not None
    full = CompiledStep(model, cuda, "all", max_num_seqs=256)  # a decode worker's "all"
    assert full.graphs and full.padded and len(full.buckets) == 15
    assert full.forward_for(True) is not full.forward_for(False)


@pytest.mark.parametrize("chunk", [1, 7])
def test_prefill_mode_runs_every_step_compiled_and_matches_transformers(tiny_model, chunk):
    llm = LLM(str(tiny_model), compile="prefill", block_size=8, max_prefill_chunk=chunk)
    compiled = llm.runner.compiled
    assert compiled.mode == "prefill" and compiled.report.graphs == ["decode T=1",
                                                                     "mixed T=2"]
    ran = {"compiled": 0}
    run = compiled.run

    def counted(*a):
        ran["compiled"] += 1
        return run(*a)

    compiled.run = counted
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    p = prompt(15, seed=15)
    assert llm.generate([p], greedy)[0].token_ids == hf_greedy(tiny_model, p, 4)
    assert ran["compiled"] > 0 and compiled.mode == "prefill"
    assert llm.block_manager.num_used_blocks == 0
