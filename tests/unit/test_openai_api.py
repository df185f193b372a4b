"""The OpenAI HTTP front door over the colocated engine (cluster/launch/local_backend.py) and the
tiny model, driven by the official `openai` client: greedy output equal to engine.LLM's,
streamed and not, chat through the chat template, stop strings and stop tokens, and a
client that leaves mid-stream; every test ends with the engine idle and no block used."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from cluster.cli import main
from cluster.config.serve import ServeConfig
from cluster.launch.local_backend import LocalBackend
from cluster.serve.server import BackgroundServer
from engine import LLM, SamplingParams
from tests.openai_door import assert_idle, chat_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NO_EOS = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    """The tiny model with a ChatML chat template (chat_template.jinja)."""
    return chat_model_dir(tiny_model, tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(str(chat_model))


@pytest.fixture(scope="module")
def served(chat_model):
    backend = LocalBackend(LLM(str(chat_model)))
    cfg = ServeConfig().with_values({"server.port": 0, "server.http_port": 0,
                                     "server.served_model_name": "tiny-chat"})
    with BackgroundServer(backend, cfg) as srv:
        client = openai.OpenAI(base_url=f"{srv.server.http_url}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        yield srv, backend, client
        client.close()



@pytest.mark.parametrize("prompt", ["Simple is better than complex.", [5, 17, 300, 42, 9]])
def test_completion_equals_engine_llm_greedy(served, llm, prompt):
    srv, backend, client = served
    want = llm.generate([prompt], GREEDY)[0]
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12,
                                  temperature=0, extra_body=NO_EOS)
    choice = r.choices[0]
    assert choice.token_ids == want.token_ids and choice.text == want.text
    assert choice.finish_reason == "length" and r.object == "text_completion"
    assert r.prompt_token_ids == want.prompt_token_ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    assert_idle(srv, backend)


def test_streamed_completion_with_usage_equals_engine_llm(served, llm):
    srv, backend, client = served
    prompt = "Errors should never pass silently."
    want = llm.generate([prompt], GREEDY)[0]
    chunks = list(client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == want.text
    assert [t for c in body for t in c.choices[0].token_ids] == want.token_ids
    assert all(c.usage is None for c in body) and body[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.total_tokens == len(want.prompt_token_ids) + 12
    assert_idle(srv, backend)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_goes_through_the_chat_template(served, llm, stream):
    srv, backend, client = served
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    want = llm.chat(messages, GREEDY)[0]
    assert want.prompt_token_ids == backend.tokenizer.apply_chat_template(
        messages[:1] + [{"role": "user", "content": "Name a color."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    kw = dict(model="tiny-chat", messages=messages, max_completion_tokens=12, temperature=0,
              extra_body=NO_EOS)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        ids = [t for c in chunks for t in c.choices[0].token_ids]
        finish = chunks[-1].choices[0].finish_reason
        assert chunks[0].object == "chat.completion.chunk"
    else:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert msg.role == "assistant" and r.object == "chat.completion"
        text, ids, finish = msg.content, r.choices[0].token_ids, r.choices[0].finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert (text, ids, finish) == (want.text, want.token_ids, "length")
    assert_idle(srv, backend)


def test_a_model_without_chat_template_answers_chat_with_400(tiny_model):
    cfg = ServeConfig().with_values({"server.port": 0, "server.http_port": 0})
    with BackgroundServer(LocalBackend(LLM(str(tiny_model))), cfg) as srv:
        r = httpx.post(f"{srv.server.http_url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "no chat template" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_request_and_is_not_in_the_output(served, llm, stream):
    srv, backend, client = served
    prompt = "Now is better than never."
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60,
                                                 ignore_eos=True))[0].text
    stop = full[len(full) // 3: len(full) // 3 + 3]
    want = full[:full.find(stop)]
    kw = dict(model="tiny-chat", prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "\x00never"],
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        last = chunks[-1].choices[0]
        assert all(stop not in c.choices[0].text for c in chunks)
    else:
        r = client.completions.create(**kw)
        text, last = r.choices[0].text, r.choices[0]
        assert r.usage.completion_tokens < 60  # ended early: the engine stopped generating
    assert text == want and last.finish_reason == "stop" and last.stop_reason == stop
    assert_idle(srv, backend)


def test_stop_token_id_is_the_stop_reason(served, llm):
    srv, backend, client = served
    prompt = [7, 8, 9, 10]
    full = llm.generate([prompt], GREEDY)[0].token_ids
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12,
                                  temperature=0, extra_body={**NO_EOS, "stop_token_ids": [full[4]]})
    c = r.choices[0]
    assert c.token_ids == full[:full.index(full[4]) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == full[4]
    assert_idle(srv, backend)


def test_client_leaving_mid_stream_frees_the_request(served):
    srv, backend, _ = served
    body = {"prompt": "Flat is better than nested.", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    steps = backend.llm.num_steps
    with httpx.stream("POST", f"{srv.server.http_url}/v1/completions", json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        st = srv.run(backend.stats())
        assert st.num_inflight == 1 and st.workers[0].kv_blocks_used > 0
    assert_idle(srv, backend)
    assert backend.llm.num_steps - steps < 4000  # aborted: it never generated them all


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_pdserve_bench_drives_either_front_door(served, capsys, tmp_path, backend):
    srv, backend_, _ = served
    addr = srv.address if backend == "grpc" else srv.server.http_url.removeprefix("http://")
    out = tmp_path / "bench.json"
    assert main(["bench", "--backend", backend, "--addr", addr, "--num-prompts", "4",
                 "--prompt-len", "20", "--output-len", "6", "--no-progress",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+4\b", text)
    assert re.search(r"Total generated tokens:\s+24\b", text)  # exact counts on both doors
    records = json.loads(out.read_text())["records"]
    assert all(r["success"] and len(r["token_times"]) == 6 for r in records)
    assert_idle(srv, backend_)
