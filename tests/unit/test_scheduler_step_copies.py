"""Per-step host work of the colocated scheduler: a step reads the tokens it feeds, not a
copy of each request's whole token list (prompt + outputs) per step."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.execute import ScheduledItem
from engine.request import Request


@pytest.mark.parametrize(("start", "num"), [(0, 5), (3, 4), (5, 2), (6, 1), (8, 2), (0, 10)])
def test_chunk_tokens_span_prompt_and_outputs(start, num):
    r = Request("r", [10, 11, 12, 13, 14, 15], SamplingParams())
    r.output_token_ids = [20, 21, 22, 23]
    r.block_ids = [0, 1, 2]
    chunk = ScheduledItem(r, start, num, is_prefill=True).to_chunk()
    assert list(chunk.token_ids) == r.all_token_ids[start:start + num]


def test_decode_steps_copy_the_token_list_once_per_full_block(tiny_model, monkeypatch):
    llm = LLM(str(tiny_model), block_size=8, num_blocks=64)
    copies = []
    real = Request.all_token_ids
    monkeypatch.setattr(Request, "all_token_ids",
                        property(lambda self: (copies.append(1), real.fget(self))[1]))
    out = llm.generate([list(range(30, 50))], SamplingParams(temperature=0, max_tokens=40,
                                                               ignore_eos=True))[0]
    assert len(out.token_ids) == 40
    # 60 tokens: 7 block boundaries crossed; the prefix lookup and the prefill add a few,
    # while one copy per step would be >= 40
    assert len(copies) <= 7 + 3, len(copies)
    llm.block_manager.check_integrity()
    assert llm.block_manager.num_used_blocks == 0
