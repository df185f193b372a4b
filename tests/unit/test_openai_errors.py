"""The OpenAI HTTP front door over a scripted fake RouterAPI (tests/unit/test_front_door.py's):
status codes as OpenAI error JSON, bearer token, drain, deadlines, request ids, tenants
and client disconnects, over real HTTP (httpx), without a model."""

from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import pytest

from cluster.config.serve import ServeConfig
from cluster.serve.server import BackgroundServer
from tests.unit.test_front_door import FakeRouter

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start(tmp_path, **limits) -> tuple[FakeRouter, BackgroundServer]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    values = {"server.port": 0, "server.http_port": 0, "server.auth_token_file": str(token_file),
              "server.served_model_name": "fake-model"}
    values.update({f"limits.{k}": v for k, v in limits.items()})
    router = FakeRouter()
    srv = BackgroundServer(router, ServeConfig().with_values(values), health_poll_s=0.02)
    srv.start()
    return router, srv


@pytest.fixture
def fake(tmp_path):
    router, srv = start(tmp_path, request_timeout_s=30.0)
    client = httpx.Client(base_url=srv.server.http_url, headers=AUTH, timeout=30)
    yield router, srv, client
    client.close()
    srv.stop(drain_timeout_s=0)


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def events(response: httpx.Response) -> list:
    """The SSE data payloads of a streamed response (JSON objects and the final "[DONE]")."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_bearer_token_is_required_except_for_health(fake):
    _, srv, _ = fake
    url = srv.server.http_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")):
            r = httpx.request(method, url + path, headers=headers, json={"prompt": "hi"})
            err = assert_error(r, 401)
            assert err["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health").json() == {"status": "serving"}
    models = httpx.get(url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert models["data"][0]["max_model_len"] == FakeRouter.max_model_len


@pytest.mark.parametrize("code,status", [
    ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503), ("INVALID_ARGUMENT", 400),
    ("ALREADY_EXISTS", 409), ("INTERNAL", 500), ("DEADLINE_EXCEEDED", 504)])
@pytest.mark.parametrize("stream", [False, True])
def test_router_errors_before_the_first_token_get_their_http_status(fake, code, status, stream):
    router, _, client = fake
    r = client.post("/v1/completions", json={"prompt": f"error:{code}", "stream": stream})
    err = assert_error(r, status)
    assert f"scripted {code}" in err["message"] and err["code"] == code.lower()
    assert client.post("/v1/completions", json={"prompt": "ok"}).json()[
        "choices"][0]["text"] == "ok"  # the server keeps serving


def test_unknown_model_path_and_method_are_404_405(fake):
    _, _, client = fake
    r = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert assert_error(r, 404, "model")["code"] == "model_not_found"
    assert_error(client.get("/v1/models/gpt-4"), 404, "model")
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert_error(client.post("/v1/nothing", json={}), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_bad_json_and_chat_without_a_tokenizer_are_400(fake):
    _, _, client = fake
    assert_error(client.post("/v1/completions", content=b"{not json"), 400)
    assert_error(client.post("/v1/completions", json=[1, 2]), 400)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                "content": "hi"}]})
    assert_error(r, 400, "messages")  # the fake backend has no tokenizer


def test_backend_bugs_are_500_and_mid_stream_errors_are_an_sse_error_event(fake):
    _, _, client = fake
    for prompt in ("boom", "early"):
        assert_error(client.post("/v1/completions", json={"prompt": prompt}), 500)
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "early", "stream": True}) as r:
        assert r.status_code == 200  # the first token came before the failure
        got = events(r)
    assert got[0]["choices"][0]["text"] == "A"
    assert got[1]["error"]["code"] is None and "early" in got[1]["error"]["message"]
    assert got[-1] == "[DONE]"
    assert client.post("/v1/completions", json={"prompt": "ok"}).status_code == 200


def test_request_id_header_tenant_and_duplicates(fake):
    router, srv, client = fake
    r = client.post("/v1/completions", headers={"x-request-id": "mine-1",
                                                "x-pdserve-tenant": "gold"},
                    json={"prompt": "hi", "user": "ignored-when-the-header-is-set"})
    assert r.headers["x-request-id"] == "mine-1" and r.json()["id"] == "mine-1"
    assert (router.specs[-1].request_id, router.specs[-1].tenant) == ("mine-1", "gold")
    client.post("/v1/completions", json={"prompt": "hi", "user": "free"})
    assert router.specs[-1].tenant == "free" and router.specs[-1].request_id.startswith("cmpl-")
    client.post("/v1/completions", json={"prompt": "hi"})
    assert router.specs[-1].tenant == "default"
    assert_error(client.post("/v1/completions", headers={"x-request-id": "x" * 300},
                             json={"prompt": "hi"}), 400, "x-request-id")
    # a second request with an in-flight id is a conflict; the first is unaffected
    with client.stream("POST", "/v1/completions", headers={"x-request-id": "dup"},
                       json={"prompt": "hang", "stream": True}) as first:
        assert first.status_code == 200
        assert _wait(lambda: "dup" in srv.server.state.active)
        r = client.post("/v1/completions", headers={"x-request-id": "dup"},
                        json={"prompt": "hi"})
        assert_error(r, 409, "x-request-id")
    assert _wait(lambda: "dup" in router.aborted and not srv.server.state.active)


def test_client_gone_before_the_answer_aborts_the_request(fake):
    router, srv, _ = fake
    url = httpx.URL(srv.server.http_url)
    conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hang"}),
                 headers={**AUTH, "x-request-id": "leaver", "content-type": "application/json"})
    assert _wait(lambda: "leaver" in srv.server.state.active)
    conn.close()  # drop the connection while the non-streamed answer is pending
    assert _wait(lambda: "leaver" in router.aborted)
    assert _wait(lambda: "leaver" not in srv.server.state.active)


def test_client_gone_mid_stream_aborts_the_request(fake):
    router, srv, client = fake
    with client.stream("POST", "/v1/completions", headers={"x-request-id": "mid"},
                       json={"prompt": "hang", "stream": True}) as r:
        next(r.iter_lines())  # the first chunk arrived; now leave
    assert _wait(lambda: "mid" in router.aborted)
    assert _wait(lambda: not srv.server.state.active)


def test_request_timeout_is_504(tmp_path):
    router, srv = start(tmp_path, request_timeout_s=0.5)
    try:
        r = httpx.post(srv.server.http_url + "/v1/completions", headers=AUTH,
                       json={"prompt": "hang"}, timeout=30)
        err = assert_error(r, 504)
        assert "request_timeout_s" in err["message"] and router.aborted
    finally:
        srv.stop(drain_timeout_s=0)


def test_drain_refuses_new_requests_and_aborts_the_running_ones(tmp_path):
    router, srv = start(tmp_path)
    url = srv.server.http_url
    client = httpx.Client(base_url=url, headers=AUTH, timeout=30)
    stopper = None
    try:
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "hang", "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            stopper = threading.Thread(target=srv.stop, kwargs={"drain_timeout_s": 30},
                                       daemon=True)
            stopper.start()
            assert _wait(lambda: srv.server.state.draining)
            assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 503)
            assert httpx.get(url + "/health").status_code == 503
            # a second stop cuts the drain short: the running stream ends as "abort"
            threading.Thread(target=srv.run, args=(srv.server.stop(0),), daemon=True).start()
            rest = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]"
                    for x in lines if x.startswith("data: ")]
        assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "abort"
        stopper.join(30)
        assert not stopper.is_alive() and router.shut_down
    finally:
        client.close()
        srv.stop(drain_timeout_s=0)
