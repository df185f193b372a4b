"""LLM offline API: bad input raises ValueError naming the problem and leaves nothing
queued, the engine keeps serving afterwards; streaming, text prompts, cancellation.
Every test ends with a leak check."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
GOOD = list(range(10, 30))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model), block_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    return llm.generate([GOOD], GREEDY)[0].token_ids


def assert_no_leak(llm: LLM) -> None:
    llm.block_manager.check_integrity()
    assert llm.block_manager.num_used_blocks == 0
    assert not llm.has_unfinished() and not llm._requests


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt is empty"),
        ("", "prompt is empty"),
        (list(range(1, 65)), "max_model_len"),  # 64 tokens leave no room in 64
        (list(range(1, 200)), "max_model_len"),
        ([5, 6, 10**6], r"token id 1000000 is outside the vocabulary"),
        ([5, -1], r"token id -1 is outside the vocabulary"),
    ],
    ids=["empty", "empty-text", "at-max-len", "over-max-len", "id-too-big", "id-negative"],
)
def test_bad_prompt_is_rejected_and_the_engine_keeps_serving(llm, reference, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY)
    assert_no_leak(llm)
    # one bad prompt rejects the whole call before anything is queued
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD, prompt], GREEDY)
    assert_no_leak(llm)
    assert llm.generate([GOOD], GREEDY)[0].token_ids == reference
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_bad_sampling_params_are_rejected_and_the_engine_keeps_serving(
    llm, reference, kwargs, message
):
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD], SamplingParams(**kwargs))
    assert llm.generate([GOOD], GREEDY)[0].token_ids == reference
    assert_no_leak(llm)


def test_params_list_of_the_wrong_length_is_rejected(llm, reference):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([GOOD], [GREEDY, GREEDY])
    assert llm.generate([GOOD], [GREEDY])[0].token_ids == reference
    assert_no_leak(llm)


def test_duplicate_request_id_is_rejected(llm):
    llm.add_request(GOOD, GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        llm.add_request(GOOD, GREEDY, request_id="dup")
    while llm.has_unfinished():
        llm.step()
    assert_no_leak(llm)


def test_add_request_rejects_bad_input_without_queueing(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([llm.config.model.vocab_size])
    assert not llm.scheduler.waiting
    assert_no_leak(llm)


def test_single_prompt_and_text_prompt_forms(llm, reference):
    assert llm.generate(GOOD, GREEDY)[0].token_ids == reference  # one list of ints
    text = "Readability counts."
    out = llm.generate(text, GREEDY)[0]
    assert out.prompt_token_ids == llm.tokenizer(text).input_ids
    assert len(out.token_ids) == 6
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert llm.generate([], GREEDY) == []
    assert_no_leak(llm)


def test_stream_deltas_add_up_to_generate(llm, reference):
    prompts = [GOOD, list(range(40, 47))]
    outs = llm.generate(prompts, GREEDY)
    got: dict[int, list[int]] = {0: [], 1: []}
    reasons = {}
    for d in llm.stream(prompts, GREEDY):
        assert d.new_token_ids  # every delta carries at least one token
        got[d.index] += d.new_token_ids
        if d.finish_reason is not None:
            reasons[d.index] = d.finish_reason.value
    assert got == {0: outs[0].token_ids, 1: outs[1].token_ids}
    assert got[0] == reference and reasons == {0: "length", 1: "length"}
    assert_no_leak(llm)


def test_stream_text_deltas_join_to_the_output_text_from_short_windows(llm, monkeypatch):
    prompts = [GOOD, list(range(40, 47))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)
    decoded: list[int] = []
    decoder = llm._batch_decoder()
    monkeypatch.setattr(decoder, "_table", None)  # the windows (a byte table decodes none)
    real = decoder.decode_many
    monkeypatch.setattr(decoder, "decode_many",
                        lambda seqs: decoded.extend(map(len, seqs)) or real(seqs))
    texts = {0: "", 1: ""}
    for d in llm.stream(prompts, params):
        texts[d.index] += d.text_delta
    assert texts == {0: outs[0].text, 1: outs[1].text}
    # mid-stream pushes decode a window of a few tokens; only the final push of each
    # request decodes its whole output (the output is never re-decoded per step)
    assert decoded.count(24) == 2 and max(n for n in decoded if n != 24) < 12
    assert_no_leak(llm)


def test_closing_a_stream_early_aborts_its_requests(llm):
    stream = llm.stream([GOOD, list(range(40, 50))],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    assert llm.block_manager.num_used_blocks > 0
    stream.close()  # a client that stops reading
    assert_no_leak(llm)


def test_abort_by_id_while_running(llm, reference):
    r = llm.add_request(GOOD, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    llm.step()
    llm.step()
    assert r.status.name == "RUNNING"
    llm.abort(r.request_id)
    assert r.finish_reason.value == "abort"
    llm.abort("never-existed")  # unknown ids are ignored
    assert llm.generate([GOOD], GREEDY)[0].token_ids == reference
    assert_no_leak(llm)


def test_stats_report_usage(llm):
    r = llm.add_request(GOOD, GREEDY)
    llm.step()
    st = llm.stats()
    assert st["num_requests_running"] == 1 and st["kv_blocks_used"] > 0
    assert 0 < st["kv_cache_usage_perc"] <= 1
    llm.abort(r.request_id)
    assert llm.stats()["kv_blocks_used"] == 0
    assert_no_leak(llm)
