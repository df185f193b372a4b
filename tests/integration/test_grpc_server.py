"""The gRPC front door over the colocated backend: real server, real engine, tiny model."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.local_backend import LocalBackend
from cluster.serve.server import BackgroundServer
from engine import LLM, SamplingParams
from tests.tls_cert import self_signed_cert

GREEDY = {"temperature": 0.0}
PROMPTS = ["Beautiful is better than ugly.", "The quick brown fox", "Errors should never",
           "Return a new list containing the items"]


@contextmanager
def serving(model_dir, values: dict | None = None, **llm_kw):
    """A LocalBackend + BackgroundServer on an ephemeral port; yields (server, client)."""
    cfg = ServeConfig().with_values({"server.port": 0, **(values or {})})
    backend = LocalBackend(LLM(str(model_dir), **llm_kw), max_queue_len=cfg.limits.max_queue_len)
    srv = BackgroundServer(backend, cfg, health_poll_s=0.05)
    srv.start()
    client = PdserveClient(srv.address, timeout=60)
    try:
        yield srv, client
    finally:
        client.close()
        srv.stop(drain_timeout_s=0)


@pytest.fixture(scope="module")
def served(tiny_model):
    with serving(tiny_model) as (srv, client):
        yield srv, client


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLM(str(tiny_model))


def wait_idle(client: PdserveClient, timeout: float = 10.0):
    """Poll until nothing runs, waits or holds KV blocks; returns the last stats."""
    end = time.monotonic() + timeout
    while True:
        s = client.stats()
        w = s.workers[0]
        idle = (w.kv_blocks_used, w.num_running, w.num_waiting, w.queue_depth,
                s.router_queue_depth, s.num_inflight) == (0, 0, 0, 0, 0, 0)
        if idle or time.monotonic() > end:
            return s
        time.sleep(0.05)


def test_concurrent_greedy_streams_match_the_offline_engine(served, reference):
    _, client = served
    ref = reference.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(pool.map(lambda p: list(client.generate(p, max_tokens=12, **GREEDY)),
                                PROMPTS))
    for chunks, want in zip(streams, ref, strict=True):
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
        assert all(c.finish_reason is None for c in chunks[:-1])
        last = chunks[-1]
        assert last.finish_reason == "length" and last.usage is not None
        assert last.usage.completion_tokens == 12
        assert 0 < last.usage.ttft_s <= last.usage.e2e_s
    ids = reference.encode(PROMPTS[0])  # a token-id prompt gives the same tokens
    assert list(client.complete(ids, max_tokens=12, **GREEDY).token_ids) == ref[0].token_ids
    assert wait_idle(client).workers[0].kv_blocks_used == 0


def test_unset_fields_take_defaults_and_zero_is_a_value(served, reference):
    _, client = served
    default = client.complete("Flat is better", ignore_eos=True, seed=7)
    assert len(default.token_ids) == 16  # max_tokens unset -> 16
    explicit = client.complete("Flat is better", ignore_eos=True, seed=7, temperature=1.0,
                               max_tokens=16)
    assert default.token_ids == explicit.token_ids  # temperature unset -> 1.0
    greedy = client.complete("Flat is better", ignore_eos=True, seed=7, temperature=0.0)
    want = reference.generate(["Flat is better"], SamplingParams(temperature=0.0, max_tokens=16,
                                                                 ignore_eos=True))[0]
    assert list(greedy.token_ids) == want.token_ids  # temperature=0 -> greedy
    assert greedy.token_ids != default.token_ids


BAD = [
    ({"prompt": ""}, "prompt.text"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x" * 1, "max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"prompt": [1, 2, 99999]}, "token_ids"),
    ({"prompt": [-1]}, "token_ids"),
    ({"stop_token_ids": [5000]}, "stop_token_ids"),
    ({"prompt": list(range(1, 200)) * 21}, "max_model_len"),  # 4179 >= 4096
    ({"ttft_deadline_ms": -1.0}, "ttft_deadline_ms"),
]


@pytest.mark.parametrize("kw, field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(served, reference, kw, field):
    _, client = served
    kw = {"prompt": "hello", **kw}
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(kw.pop("prompt"), **kw))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    # ... and the server keeps serving correct tokens
    want = reference.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert list(client.complete("hello", max_tokens=4, **GREEDY).token_ids) == want.token_ids


def test_duplicate_active_request_id_is_already_exists(served):
    _, client = served
    stream = client.generate("Now is better than never.", request_id="dup", max_tokens=3000,
                             ignore_eos=True)
    it = iter(stream)
    next(it)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("again", request_id="dup"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert client.abort("dup") is True
    assert [c for c in it][-1].finish_reason == "abort"  # Abort RPC ends the stream
    assert client.abort("dup") is False
    assert wait_idle(client).workers[0].kv_blocks_used == 0


@pytest.mark.parametrize("ending", ["finished", "abort-rpc", "client-cancel", "invalid"])
def test_a_request_id_is_free_the_moment_its_request_ended(served, reference, ending):
    """The same id again right after the end (Abort: before the old stream is even read
    to its end); served exactly, nothing leaked."""
    _, client = served
    rid = f"again-{ending}"
    if ending == "finished":
        assert client.complete("Sparse", request_id=rid, max_tokens=2).finish_reason
    elif ending == "invalid":
        with pytest.raises(grpc.RpcError):
            list(client.generate("hi", request_id=rid, top_k=0))
    else:
        stream = client.generate("Readability counts.", request_id=rid, max_tokens=3000,
                                 ignore_eos=True)
        it = iter(stream)
        next(it)
        if ending == "abort-rpc":
            assert client.abort(rid) is True
        else:
            stream.cancel()
    want = reference.generate(["Special cases"], SamplingParams(temperature=0.0,
                                                                max_tokens=5))[0]
    again = client.complete("Special cases", request_id=rid, max_tokens=5, **GREEDY)
    assert list(again.token_ids) == want.token_ids
    if ending == "abort-rpc":
        assert list(it)[-1].finish_reason == "abort"
    s = wait_idle(client)
    assert (s.workers[0].kv_blocks_used, s.num_inflight) == (0, 0)


def test_client_cancel_aborts_the_request_and_frees_everything(served):
    _, client = served
    stream = client.generate("Although never is often better than right now.",
                             max_tokens=3000, ignore_eos=True)
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                stream.cancel()
    assert e.value.code() == grpc.StatusCode.CANCELLED
    s = wait_idle(client)  # stopped long before 3000 tokens, and nothing leaked
    w = s.workers[0]
    assert (w.kv_blocks_used, w.num_running, w.num_waiting, s.num_inflight) == (0, 0, 0, 0)


def test_full_queue_answers_resource_exhausted(tiny_model):
    values = {"limits.max_queue_len": 2}
    with serving(tiny_model, values, max_num_seqs=1) as (_, client):
        def run(i):
            try:
                client.complete(f"Sparse is better than dense {i}", max_tokens=40,
                                ignore_eos=True)
                return "ok"
            except grpc.RpcError as e:
                return e.code()

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(run, range(8)))
        assert results.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 4, results
        assert "ok" in results
        assert wait_idle(client).workers[0].kv_blocks_used == 0


def test_request_timeout_is_deadline_exceeded(tiny_model):
    with serving(tiny_model, {"limits.request_timeout_s": 0.5}) as (_, client):
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate("In the face of ambiguity", request_id="late",
                                 max_tokens=4000, ignore_eos=True))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # the id is free again at once
        assert client.complete("hi", request_id="late", max_tokens=1).finish_reason
        assert wait_idle(client).workers[0].kv_blocks_used == 0


def test_health_reflection_and_drain(tiny_model):
    with serving(tiny_model) as (srv, client):
        assert client.health() == "SERVING"
        assert client.health("pdserve.v1.Generation") == "SERVING"
        info = client.model_info()
        assert info.vocab_size > 0 and info.max_model_len == 4096
        with grpc.insecure_channel(srv.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            resp = next(stub.ServerReflectionInfo(iter([req])))
            names = {s.name for s in resp.list_services_response.service}
        assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names

        stream = iter(client.generate("Namespaces are one honking great idea", max_tokens=150,
                                      ignore_eos=True, **GREEDY))
        first = next(stream)
        stopper = threading.Thread(target=srv.stop, kwargs={"drain_timeout_s": 30})
        stopper.start()
        end = time.monotonic() + 5
        while client.health() != "NOT_SERVING" and time.monotonic() < end:
            time.sleep(0.02)
        assert client.health() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate("late", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)  # the running request drains to completion
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 150
        stopper.join(30)
        assert not stopper.is_alive()
        assert srv.router.healthy() is False  # router shut down after the drain


def _check_auth(address: str, token: str, tls_ca=None):
    with PdserveClient(address, tls_ca=tls_ca, timeout=30) as anonymous:
        assert anonymous.health() == "SERVING"  # health is exempt
        for call in (lambda: list(anonymous.generate("hi", max_tokens=2)), anonymous.stats):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with PdserveClient(address, token="wrong-" + token, tls_ca=tls_ca, timeout=30) as wrong:
        with pytest.raises(grpc.RpcError) as e:
            list(wrong.generate("hi", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with PdserveClient(address, token=token, tls_ca=tls_ca, timeout=30) as ok:
        chunks = list(ok.generate("Simple is better than complex.", max_tokens=6, **GREEDY))
        assert sum(len(c.token_ids) for c in chunks) == 6
        assert ok.stats().workers[0].role == "colocated"


def test_bearer_token_auth(tiny_model, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with serving(tiny_model, {"server.auth_token_file": str(token_file)}) as (srv, _):
        _check_auth(srv.address, "s3cret-token")


def test_tls_with_a_self_signed_certificate(tiny_model, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("tls-token")
    values = {"server.tls_cert": str(cert), "server.tls_key": str(key),
              "server.auth_token_file": str(token_file)}
    with serving(tiny_model, values) as (srv, _):
        _check_auth(srv.address, "tls-token", tls_ca=str(cert))
