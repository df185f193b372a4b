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


def test_graph_steps_rewrite_only_changed_table_entries(padded_llm, tiny_model):
    """Issue 37, item 4: a padded (CUDA-graph) decode step no longer pads every block
    table to max_model_len / block_size in Python: the tables live on the device at a fixed
    address and a step uploads only the entries that changed (a row's new block, or the
    table of a request that took the row). Outputs stay transformers'."""
    from engine.model_runner import ModelRunner

    llm = padded_llm
    runner = llm.runner
    tables = runner._graph_tables
    width = runner._graph_width
    assert tables.table.shape == (4, width) and width >= 16
    packed: list[int] = []  # ints the Python table packing wrote, per call
    real_table, real_update, real_place = ModelRunner._table, tables.update, tables.place
    placed: list[list[str]] = []  # each padded step's request ids, in row order
    steps: list[tuple[int, int, list[tuple[int, ...]]]] = []  # (rows, written, tables)

    def table(buf, ts):
        out = real_table(buf, ts)
        packed.append(out[1] * out[2])
        return out

    def update(ts, rows):
        before = tables.written
        view = real_update(ts, rows)
        steps.append((rows, tables.written - before, list(ts)))
        for r, t in enumerate(ts):  # the device rows hold the tables, in place
            assert view[r, :len(t)].tolist() == list(t)
        assert view.data_ptr() == tables.table.data_ptr()
        return view

    def place(decodes):
        out = real_place(decodes)
        placed.append([c.request_id for c in out])
        return out

    ModelRunner._table = staticmethod(table)
    tables.update, tables.place = update, place
    try:
        prompts = [prompt(n, seed=n) for n in (5, 2, 13, 7)]
        lengths = (9, 3, 14, 6)  # rows finish at different steps: the batch shrinks
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in lengths]
        outs = llm.generate(prompts, params)
    finally:
        ModelRunner._table = staticmethod(real_table)
        tables.update, tables.place = real_update, real_place
    for p, o, n in zip(prompts, outs, lengths, strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, n)
    assert len(steps) >= 10
    # graph steps packed no padded decode table: the tables that were packed in Python
    # belong to prefill steps and the empty prefill table of graph steps
    assert max(packed) < width * 4
    # a step writes the blocks that are new since the last one, and nothing for the rest
    prev: list[tuple[int, ...]] = [()] * 4
    for _rows, written, ts in steps:
        new = 0
        for r, t in enumerate(ts):
            old = prev[r]
            if t != old:
                new += len(t) - (len(old) if t[:len(old)] == old else 0)
                prev[r] = t
        assert written == new
    assert sum(w for _, w, _ in steps) < sum(r for r, _, _ in steps) * width / 4
    assert sum(w == 0 for _, w, _ in steps) >= 3  # steps with no new block wrote nothing
    # a request keeps its row while the batch shrinks around it (or moves into a hole
    # when its row is past the batch's end): rows do not shift up after a leaver
    assert any(len(b) < len(a) for a, b in zip(placed, placed[1:], strict=False))
    for a, b in zip(placed, placed[1:], strict=False):
        for rid in set(a) & set(b):
            if a.index(rid) < len(b):
                assert b.index(rid) == a.index(rid), (a, b)
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()
