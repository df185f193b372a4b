"""Log-probs through both front doors of the colocated backend (cluster/launch/local_backend.py)
on the tiny model in fp32: the official `openai` client (completions `logprobs` and
`echo` as lm-eval's local-completions sends them, chat `logprobs`/`top_logprobs`, vLLM's
`prompt_logprobs`, streamed and not) and gRPC, every value equal to transformers'
log_softmax to 1e-5; the bounds answered with a 400 / INVALID_ARGUMENT naming the field;
`--logprobs-mode raw`. Every test ends with the engine idle and no block used."""

from __future__ import annotations

import math

import grpc
import httpx
import openai
import pytest

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.local_backend import LocalBackend
from cluster.serve.server import BackgroundServer
from engine import LLM
from engine.logprobs import TokenLogprobs
from tests.logprobs_ref import ATOL, check_entry, check_prompt, hf_logits, hf_logprobs
from tests.openai_door import assert_idle, chat_model_dir

MAX_LOGPROBS = 8
PROMPT = [5, 17, 300, 42, 9, 1000, 77, 12, 640]


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    return chat_model_dir(tiny_model, tmp_path_factory.mktemp("tiny-chat-lp"))


def _serve(model_dir, **values):
    backend = LocalBackend(LLM(str(model_dir)))
    cfg = ServeConfig().with_values({"server.port": 0, "server.http_port": 0,
                                     "server.served_model_name": "tiny",
                                     "limits.max_logprobs": MAX_LOGPROBS, **values})
    return backend, BackgroundServer(backend, cfg)


@pytest.fixture(scope="module")
def served(chat_model):
    backend, server = _serve(chat_model)
    with server as srv:
        client = openai.OpenAI(base_url=f"{srv.server.http_url}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        yield srv, backend, client
        client.close()



def text_of(backend, token_id: int) -> str:
    return backend.tokenizer.decode([token_id])


def as_entry(backend, row_text: str, value: float, top: dict[str, float], token_id: int,
             ref_row, n: int) -> None:
    """A completions logprobs position against the reference row: the token's text and
    value, and top_logprobs = {its text: value, the n most likely's texts: values}."""
    assert row_text == text_of(backend, token_id)
    assert abs(value - ref_row[token_id].item()) <= ATOL
    want = {text_of(backend, token_id): ref_row[token_id].item()}
    for t in ref_row.topk(n).indices.tolist():
        want.setdefault(text_of(backend, t), ref_row[t].item())
    assert list(top) == list(want)
    assert all(abs(top[k] - want[k]) <= ATOL for k in want)


def test_completion_logprobs_equal_transformers_streamed_or_not(served, chat_model):
    srv, backend, client = served
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    choice = r.choices[0]
    lp = choice.logprobs
    ref = hf_logprobs(chat_model, PROMPT + choice.token_ids)
    assert lp.tokens == [text_of(backend, t) for t in choice.token_ids]
    for i, t in enumerate(choice.token_ids):
        as_entry(backend, lp.tokens[i], lp.token_logprobs[i], lp.top_logprobs[i], t,
                 ref[len(PROMPT) - 1 + i], 3)
        assert len(lp.top_logprobs[i]) == 3  # greedy: the chosen token is the top one
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(6)]
    assert getattr(choice, "prompt_logprobs", None) is None  # not asked for
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for s in streamed for x in getattr(s, field)] == getattr(lp, field)
    assert_idle(srv, backend)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_does(served, chat_model):
    """lm-eval's local-completions loglikelihood request: the context + continuation as
    token ids, echo, logprobs=1, max_tokens=1, temperature 0."""
    srv, backend, client = served
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                  logprobs=1, echo=True, seed=1234,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice, lp = r.choices[0], r.choices[0].logprobs
    ids = PROMPT + choice.token_ids
    ref = hf_logprobs(chat_model, ids)
    assert choice.text == backend.tokenizer.decode(PROMPT) + backend.detokenize(
        choice.token_ids)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for i in range(1, len(ids)):
        as_entry(backend, lp.tokens[i], lp.token_logprobs[i], lp.top_logprobs[i], ids[i],
                 ref[i - 1], 1)
    ctxlen = 4  # what lm-eval computes from the response
    continuation = sum(lp.token_logprobs[ctxlen:-1])
    want = sum(ref[i - 1, ids[i]].item() for i in range(ctxlen, len(PROMPT)))
    assert math.isclose(continuation, want, abs_tol=1e-4)
    # echo without logprobs: the prompt's text, no log-probs
    plain = client.completions.create(model="tiny", prompt="Hello there", max_tokens=2,
                                      echo=True, extra_body={"ignore_eos": True})
    assert plain.choices[0].text.startswith("Hello there") and plain.choices[0].logprobs is None
    assert_idle(srv, backend)


def test_vllm_prompt_logprobs_on_completions_and_chat(served, chat_model):
    srv, backend, client = served
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    got = r.choices[0].prompt_logprobs
    ref = hf_logprobs(chat_model, PROMPT)
    assert r.choices[0].logprobs is None and len(got) == len(PROMPT) and got[0] is None
    for i in range(1, len(PROMPT)):
        pos = {int(t): v for t, v in got[i].items()}
        assert list(pos)[0] == PROMPT[i]  # the prompt token itself, then the 2 most likely
        mine = pos[PROMPT[i]]
        top = ref[i - 1].topk(2).indices.tolist()
        assert set(pos) == {PROMPT[i], *top}
        check_entry(TokenLogprobs(PROMPT[i], mine["logprob"], mine["rank"],
                                  tuple((t, pos[t]["logprob"]) for t in top)),
                    ref[i - 1], PROMPT[i], 2)
        assert [pos[t]["rank"] for t in top if t != PROMPT[i]] == [
            r for r, t in enumerate(top, 1) if t != PROMPT[i]]
        assert all(v["decoded_token"] == text_of(backend, t) for t, v in pos.items())
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=2,
        temperature=0, extra_body={"prompt_logprobs": 1, "ignore_eos": True,
                                   "return_token_ids": True})
    prompt_ids = chat.prompt_token_ids
    assert len(chat.prompt_logprobs) == len(prompt_ids) and chat.prompt_logprobs[0] is None
    ref = hf_logprobs(chat_model, prompt_ids)
    for i in range(1, len(prompt_ids)):
        mine = chat.prompt_logprobs[i][str(prompt_ids[i])]
        assert abs(mine["logprob"] - ref[i - 1, prompt_ids[i]].item()) <= ATOL
    assert_idle(srv, backend)


def test_chat_logprobs_equal_transformers_streamed_or_not(served, chat_model):
    srv, backend, client = served
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}],
              max_tokens=8, temperature=0, logprobs=True, top_logprobs=4,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    content = choice.logprobs.content
    ids = choice.token_ids
    ref = hf_logprobs(chat_model, list(r.prompt_token_ids) + ids)
    p = len(r.prompt_token_ids)
    assert len(content) == len(ids)
    for i, (t, c) in enumerate(zip(ids, content, strict=True)):
        assert c.token == text_of(backend, t)
        assert abs(c.logprob - ref[p - 1 + i, t].item()) <= ATOL
        want = ref[p - 1 + i].topk(4)
        assert [x.token for x in c.top_logprobs] == [text_of(backend, j)
                                                     for j in want.indices.tolist()]
        assert all(abs(x.logprob - v) <= ATOL for x, v in zip(c.top_logprobs,
                                                               want.values.tolist(),
                                                               strict=True))
    # the tokens' own bytes (byte-level BPE) join into the output's, even where a token
    # holds part of a character (here: stray UTF-8 continuation bytes, text U+FFFD)
    joined = bytes(b for c in content for b in c.bytes)
    assert joined.decode("utf-8", errors="replace") == backend.tokenizer.decode(ids)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    assert len(streamed) == len(content)
    for x, y in zip(streamed, content, strict=True):  # this prompt now hits the prefix
        assert (x.token, x.bytes) == (y.token, y.bytes)  # cache: fp32 rounding differs
        assert abs(x.logprob - y.logprob) <= ATOL
        assert [(z.token, z.bytes) for z in x.top_logprobs] == [
            (z.token, z.bytes) for z in y.top_logprobs]
        assert all(abs(u.logprob - v.logprob) <= ATOL
                   for u, v in zip(x.top_logprobs, y.top_logprobs, strict=True))
    assert_idle(srv, backend)


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs",
     f"logprobs must be in [0, {MAX_LOGPROBS}]"),
    ("completions", {"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs",
     f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
    ("completions", {"logprobs": MAX_LOGPROBS + 1, "echo": True}, "logprobs", "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs", "logprobs must be >= 0"),
    ("completions", {"prompt_logprobs": -2}, "prompt_logprobs", "prompt_logprobs must be"),
    ("completions", {"logprobs": True}, "logprobs", "integer"),
    ("completions", {"top_logprobs": 2}, "top_logprobs", "chat completions parameter"),
    ("chat/completions", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
     "top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}]"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", ">= 0"),
    ("chat/completions", {"logprobs": 3}, "logprobs", "boolean"),
])
def test_bad_logprob_fields_are_a_400_naming_the_field(served, path, body, param, says):
    srv, backend, _ = served
    base = {"prompt": "hi"} if path == "completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{srv.server.http_url}/v1/{path}", json={**base, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert_idle(srv, backend)


def test_grpc_logprobs_equal_transformers(served, chat_model):
    srv, backend, _ = served
    with PdserveClient(srv.address, timeout=60) as c:
        chunks = list(c.generate(PROMPT, max_tokens=5, temperature=0, ignore_eos=True,
                                 logprobs=2, prompt_logprobs=3))
        assert all(len(ch.logprobs) == len(ch.token_ids) for ch in chunks)
        assert chunks[0].prompt_logprobs and not any(ch.prompt_logprobs for ch in chunks[1:])
        ids = [t for ch in chunks for t in ch.token_ids]
        ref = hf_logprobs(chat_model, PROMPT + ids)
        for i, lp in enumerate(lp for ch in chunks for lp in ch.logprobs):
            check_entry(lp, ref[len(PROMPT) - 1 + i], ids[i], 2)
        check_prompt((None, *chunks[0].prompt_logprobs), ref, PROMPT, 3)
        plain = c.complete(PROMPT, max_tokens=2, temperature=0)
        assert plain.logprobs == () and plain.prompt_logprobs == ()
        for kw, field in (({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
                          ({"prompt_logprobs": -1}, "prompt_logprobs")):
            with pytest.raises(grpc.RpcError) as info:
                c.complete(PROMPT, max_tokens=2, **kw)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(f"{field} must be in [0, {MAX_LOGPROBS}]")
    assert_idle(srv, backend)


def test_logprobs_mode_raw_reports_the_model_distribution(chat_model):
    """A sampled request (temperature 0.5, top-k 3): `--logprobs-mode raw` reports
    log_softmax(logits); the default (processed) the distribution it was drawn from."""
    kw = dict(max_tokens=6, temperature=0.5, top_k=3, seed=3, ignore_eos=True, logprobs=3)
    for mode in ("raw", "processed"):
        backend, server = _serve(chat_model, **{"model.logprobs_mode": mode})
        with server as srv, PdserveClient(srv.address, timeout=60) as c:
            out = c.complete(PROMPT, **kw)
            logits = hf_logits(chat_model, PROMPT + list(out.token_ids))
            for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
                row = logits[len(PROMPT) - 1 + i]
                if mode == "raw":
                    want = row.log_softmax(dim=-1)
                else:
                    kept = row >= row.topk(3).values[-1]
                    want = (row / 0.5).masked_fill(~kept, float("-inf")).log_softmax(dim=-1)
                check_entry(lp, want, t, 3)
            assert_idle(srv, backend)
