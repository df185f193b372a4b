"""The OpenAI front door's request validation (one shared path with gRPC's
spec_from_request), stop strings over streamed text, and response shapes; no server."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.grpc.intake import PromptIntake
from cluster.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse_body,
)
from cluster.http.responses import Shaper
from cluster.http.run import Piece
from cluster.http.stop_strings import StopStrings

VOCAB, MAX_LEN = 256, 64


class _ByteRouter:
    """The intake's view of a router: bytes as tokens."""

    vocab_size, max_model_len = VOCAB, MAX_LEN

    @staticmethod
    def tokenize(text: str) -> list[int]:
        return list(text.encode())


def spec_of(model, body: dict, max_prompt_tokens: int | None = None, **kw):
    req = parse_body(model, body)
    prompt = req.single_prompt() if model is CompletionRequest else [5, 6, 7]
    grpc_req = req.to_request(prompt, request_id="r1",
                              tenant=kw.pop("tenant", body.get("user", "")), **kw)
    intake = PromptIntake(_ByteRouter(), max_prompt_tokens=max_prompt_tokens)
    try:
        return asyncio.run(intake.spec(grpc_req, "r1"))
    except ValueError as e:
        raise req.invalid(e) from e
    finally:
        intake.close()


def rejected(model, body: dict, **kw) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        spec_of(model, body, **kw)
    assert info.value.status == 400
    return info.value


def test_a_valid_completion_maps_onto_the_grpc_spec():
    spec = spec_of(CompletionRequest, {
        "prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
        "seed": 3, "stop_token_ids": [9], "ignore_eos": True, "user": "gold", "priority": 2},
        tenant="gold")
    sp = spec.sampling
    assert spec.prompt_token_ids == tuple(b"hi") and spec.tenant == "gold"
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (7, 0.5, 0.9, 4, 3)
    assert sp.stop_token_ids == (9,) and sp.ignore_eos and spec.priority == 2
    # unset fields take the gRPC door's defaults (one place for them)
    assert spec_of(CompletionRequest, {"prompt": [1, 2]}).sampling.max_tokens == 16
    assert spec_of(CompletionRequest, {"prompt": [[1, 2]]}).prompt_token_ids == (1, 2)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": 0}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "user": "u" * 300}, "user"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": list(range(MAX_LEN))}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": 5}, "prompt"),
])
def test_bad_completion_fields_are_400_naming_the_field(body, param):
    assert rejected(CompletionRequest, body).param == param


@pytest.mark.parametrize("body,param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"temperature": -0.5}, "temperature"),
])
def test_bad_chat_fields_name_the_chat_spelling(body, param):
    assert rejected(ChatCompletionRequest, {"messages": [], **body}).param == param


def test_chat_prompt_errors_name_messages():
    err = rejected(ChatCompletionRequest, {"messages": []}, max_prompt_tokens=2)
    assert err.param == "messages" and "max_prompt_tokens" in err.message


@pytest.mark.parametrize("model,field,value", [
    (CompletionRequest, "best_of", 2), (CompletionRequest, "suffix", "x"),
    (CompletionRequest, "presence_penalty", 0.5), (CompletionRequest, "logit_bias", {"5": 1}),
    (ChatCompletionRequest, "tools", [{"type": "function"}]),
    (ChatCompletionRequest, "response_format", {"type": "json_object"}),
])
def test_fields_not_supported_yet_are_a_400_never_ignored(model, field, value):
    body = {"prompt": "x"} if model is CompletionRequest else {"messages": []}
    with pytest.raises(OpenAIError) as info:
        parse_body(model, {**body, field: value})
    e = info.value
    assert (e.status, e.param, e.code) == (400, field, "unsupported_parameter")
    assert "not supported yet" in e.message and field in e.message


def test_off_values_of_unsupported_fields_are_accepted():
    parse_body(CompletionRequest, {"prompt": "x", "echo": False, "presence_penalty": 0.0,
                                   "frequency_penalty": 0, "best_of": 1, "logit_bias": {}})
    parse_body(ChatCompletionRequest, {"messages": [], "logprobs": False, "top_logprobs": 0,
                                       "tools": [], "response_format": {"type": "text"},
                                       "metadata": {"k": "v"}, "store": False})


def test_error_body_is_openai_shaped():
    e = OpenAIError(404, "no such model", "model", "model_not_found")
    assert e.body() == {"error": {"message": "no such model", "type": "not_found_error",
                                  "param": "model", "code": "model_not_found"}}


# ---- stop strings -----------------------------------------------------------------------
def test_stop_string_split_across_deltas_is_cut_and_never_released():
    s = StopStrings(["STOP"])
    out = [s.push("hello ST"), s.push("O"), s.push("P and more")]
    assert "".join(out) == "hello " and s.matched == "STOP"
    assert out[0] == "hello " and out[1] == ""  # "ST", "STO" were held back
    assert s.push("later", final=True) == ""


def test_held_text_is_released_when_it_cannot_start_a_match_or_at_the_end():
    s = StopStrings(["abc"])
    assert s.push("xa") == "x"
    assert s.push("b") == ""
    assert s.push("d") == "abd" and s.matched is None
    assert s.push("ab", final=True) == "ab"


def test_earliest_stop_wins_and_include_keeps_it():
    s = StopStrings(["world", "o w"], include=True)
    assert s.push("hello world") == "hello w" and s.matched == "o w"


@given(st.text(alphabet="abc ", max_size=40), st.lists(st.integers(0, 40), max_size=8),
       st.sampled_from([["ab"], ["b c", "ca"], ["aaa"], []]))
def test_released_text_is_the_text_up_to_the_first_stop(text, cuts, stops):
    s = StopStrings(stops)
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    released = "".join(s.push(text[a:b], final=b == len(text))
                       for a, b in zip(bounds, bounds[1:], strict=False))
    hits = [i for i in (text.find(x) for x in stops) if i >= 0]
    want = text[:min(hits)] if hits else text
    assert released == want


# ---- response shapes --------------------------------------------------------------------
def test_chat_chunks_start_with_the_role_and_end_with_the_finish_reason():
    sh = Shaper("chatcmpl-1", "m", chat=True, prompt_token_ids=(1, 2), return_token_ids=True)
    first = sh.chunk(Piece("Hi", (5,)), None, include_usage=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert first["prompt_token_ids"] == [1, 2] and first["choices"][0]["token_ids"] == [5]
    last = sh.chunk(Piece("", (6,), "stop", "END"), None, include_usage=False)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["stop_reason"] == "END" and "usage" not in last
    assert sh.usage_chunk({"total_tokens": 3})["choices"] == []
    body = Shaper("cmpl-1", "m", chat=False, prompt_token_ids=(1,)).body(
        "text", [5], "length", None, {"total_tokens": 2})
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "text"
    assert body["choices"][0]["logprobs"] is None and "token_ids" not in body["choices"][0]
