"""Input fuzzing over gRPC: malformed and extreme GenerateRequests, unknown fields,
garbage bytes on the wire and duplicate request ids. Every answer is INVALID_ARGUMENT
with a message naming a bad field, or one of these documented statuses:

  ALREADY_EXISTS  a request_id that is still active
  UNKNOWN         a body that is not a GenerateRequest at all (grpcio's own answer to a
                  request deserializer error: "Unexpected ... DecodeError: ...")

A well-formed request (unknown fields included: proto3 ignores them) is served, and
after the storm the server still streams exactly engine.LLM's greedy tokens and holds
nothing. Hypothesis drives the colocated backend (fast); test_soak.py runs MALFORMED
against the disaggregated service.
"""

from __future__ import annotations

import math
import time
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.launch.local_backend import LocalBackend
from cluster.serve.server import BackgroundServer
from engine import LLM, SamplingParams
from proto.pdserve.v1 import pdserve_pb2 as pb

GENERATE = "/pdserve.v1.Generation/Generate"
I32, I64 = (-(1 << 31), (1 << 31) - 1), (-(1 << 63), (1 << 63) - 1)
UNKNOWN_FIELDS = b"\xb8\x3e\x05" + b"\xc2\x3e\x03abc"  # field 999 varint, field 1000 bytes


def _req(ids=(1, 2, 3), **kw) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=kw.pop("request_id", f"fz-{uuid.uuid4().hex[:12]}"), **kw)
    if ids is not None:
        r.token_ids.SetInParent()
        r.token_ids.ids.extend(ids)
    return r


# name -> (wire bytes, expected status or None for "served"); used here and in test_soak
MALFORMED: dict[str, tuple[bytes, str | None]] = {
    "no prompt": (_req(ids=None, max_tokens=2).SerializeToString(), "INVALID_ARGUMENT"),
    "empty token ids": (_req(ids=(), max_tokens=2).SerializeToString(), "INVALID_ARGUMENT"),
    "empty text": (pb.GenerateRequest(text="", max_tokens=2).SerializeToString(),
                   "INVALID_ARGUMENT"),
    "token id outside vocab": (_req(ids=(1, 1 << 30)).SerializeToString(), "INVALID_ARGUMENT"),
    "negative token id": (_req(ids=(-7, 1)).SerializeToString(), "INVALID_ARGUMENT"),
    "prompt over max_model_len": (_req(ids=[1] * 5000).SerializeToString(), "INVALID_ARGUMENT"),
    "negative temperature": (_req(temperature=-1.0).SerializeToString(), "INVALID_ARGUMENT"),
    "nan temperature": (_req(temperature=math.nan).SerializeToString(), "INVALID_ARGUMENT"),
    "top_p zero": (_req(top_p=0.0).SerializeToString(), "INVALID_ARGUMENT"),
    "top_k zero": (_req(top_k=0).SerializeToString(), "INVALID_ARGUMENT"),
    "max_tokens zero": (_req(max_tokens=0).SerializeToString(), "INVALID_ARGUMENT"),
    "negative seed": (_req(seed=-1).SerializeToString(), "INVALID_ARGUMENT"),
    "stop token outside vocab": (_req(stop_token_ids=[1 << 20]).SerializeToString(),
                                 "INVALID_ARGUMENT"),
    "request_id too long": (_req(request_id="x" * 300).SerializeToString(), "INVALID_ARGUMENT"),
    "garbage bytes": (b"\xff\xfe\xfd garbage \x00\x01", "UNKNOWN"),
    "bad utf-8 text": (b"\x12\x02\xff\xfe", "UNKNOWN"),
    "truncated message": (_req(max_tokens=2).SerializeToString()[:-1], "UNKNOWN"),
    "unknown fields": (_req(max_tokens=2, temperature=0.0).SerializeToString() + UNKNOWN_FIELDS,
                       None),
}


def raw_generate(channel: grpc.Channel):
    """Generate with identity (de)serializers: any bytes go on the wire as the body."""
    return channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)


def first_answer(channel: grpc.Channel, body: bytes, timeout: float = 120.0):
    """("OK", first response) or (status name, details); a started stream is cancelled."""
    call = raw_generate(channel)(body, timeout=timeout)
    try:
        first = next(iter(call))
        return "OK", pb.GenerateResponse.FromString(first)
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""
    finally:
        call.cancel()


def assert_rejected(client_or_addr, body: bytes, name: str, expected: str | None = None) -> None:
    """`body` is answered with `expected` (None: served) and a non-empty message."""
    addr = client_or_addr.addr if isinstance(client_or_addr, PdserveClient) else client_or_addr
    expected = MALFORMED[name][1] if expected is None and name in MALFORMED else expected
    with grpc.insecure_channel(addr) as ch:
        code, detail = first_answer(ch, body)
    if expected is None:
        assert code == "OK", (name, code, detail)
    else:
        assert code == expected, (name, code, detail)
        assert detail, f"{name}: {code} without a message"


# ---- the colocated backend, fuzzed by hypothesis ----------------------------------------
@pytest.fixture(scope="module")
def served(tiny_model):
    cfg = ServeConfig().with_values({"server.port": 0, "limits.request_timeout_s": 120})
    llm = LLM(str(tiny_model))
    srv = BackgroundServer(LocalBackend(llm, max_queue_len=64), cfg, health_poll_s=0.05)
    srv.start()
    with PdserveClient(srv.address, timeout=120) as client, \
            grpc.insecure_channel(srv.address) as channel:
        yield srv, client, channel
    srv.stop(drain_timeout_s=0)


def _unset_or(values):
    return st.one_of(st.none(), st.sampled_from(values))


@st.composite
def generate_requests(draw, vocab: int, max_len: int):
    """(request bytes, names of the fields that make it invalid)."""
    bad: set[str] = set()
    rid = f"fz-{uuid.uuid4().hex}"
    rid += "x" * max(0, draw(st.sampled_from([0, 200, 256, 257, 2000])) - len(rid))
    bad |= {"request_id"} if len(rid) > 256 else set()
    tenant = "t" * draw(st.sampled_from([0, 5, 256, 257, 4000]))
    bad |= {"tenant"} if len(tenant) > 256 else set()
    req = pb.GenerateRequest(request_id=rid, tenant=tenant,
                             priority=draw(st.sampled_from([I32[0], 0, 3, I32[1]])))
    kind = draw(st.sampled_from(["unset", "text", "ids", "ids", "ids", "huge"]))
    if kind == "unset":
        bad.add("prompt")
    elif kind == "text":
        req.text = draw(st.sampled_from(["", "Hello", "Errors should never pass silently"]))
        bad |= {"prompt"} if not req.text else set()
    else:
        n = draw(st.sampled_from([max_len, max_len + 999])) if kind == "huge" else \
            draw(st.integers(0, 40))
        ids = draw(st.lists(st.one_of(st.integers(1, vocab - 1), st.integers(*I32)),
                            min_size=min(n, 40), max_size=min(n, 40)))
        ids = (ids * (n // max(1, len(ids)) + 1))[:n] if ids else []
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(ids)
        if not ids or len(ids) >= max_len or any(not 0 <= t < vocab for t in ids):
            bad.add("prompt")
    nan, inf = math.nan, math.inf
    for name, values, ok in (
        ("temperature", [-1e300, -1.0, 0.0, 0.7, 1e30, nan, inf, -inf],
         lambda v: math.isfinite(v) and v >= 0),
        ("top_p", [-1.0, 0.0, 1e-300, 0.5, 1.0, 1.0000001, 2.0, nan, inf],
         lambda v: math.isfinite(v) and 0 < v <= 1),
        ("top_k", [I32[0], -2, -1, 0, 1, 50, I32[1]], lambda v: v == -1 or v >= 1),
        ("max_tokens", [I32[0], -1, 0, 1, 3, I32[1]], lambda v: v >= 1),
        ("seed", [I64[0], -1, 0, 1, I64[1]], lambda v: v >= 0),
        ("ttft_deadline_ms", [-1.0, 0.0, 1e-300, 100.0, 1e300, nan, inf],
         lambda v: math.isfinite(v) and v > 0),
    ):
        v = draw(_unset_or(values))
        if v is not None:
            setattr(req, name, v)
            bad |= set() if ok(v) else {name}
    stops = draw(st.lists(st.integers(-3, vocab + 3), max_size=4))
    req.stop_token_ids.extend(stops)
    bad |= {"stop_token_ids"} if any(not 0 <= t < vocab for t in stops) else set()
    if draw(st.booleans()):
        req.ignore_eos = draw(st.booleans())
    body = req.SerializeToString()
    if draw(st.booleans()):
        body += UNKNOWN_FIELDS  # never changes the verdict
    return body, bad


def _check(channel, body: bytes, bad: set[str]) -> None:
    code, detail = first_answer(channel, body)
    if bad:
        assert code == "INVALID_ARGUMENT", (bad, code, detail)
        assert any(f in detail for f in bad), (bad, detail)
    else:
        assert code == "OK", (code, detail)
        assert isinstance(detail, pb.GenerateResponse)


def test_hypothesis_malformed_and_extreme_requests(served):
    srv, client, channel = served
    info = client.model_info()

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(generate_requests(info.vocab_size, info.max_model_len))
    def check(case):
        _check(channel, *case)

    check()


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64))
def test_hypothesis_garbage_bytes_get_a_status_with_a_message(served, body):
    _, _, channel = served
    code, detail = first_answer(channel, body)
    # random bytes may even decode as a (valid or invalid) GenerateRequest
    assert code in ("OK", "INVALID_ARGUMENT", "UNKNOWN"), (code, detail)
    assert detail


@pytest.mark.parametrize("name", list(MALFORMED))
def test_each_malformed_case(served, name):
    _, client, _ = served
    assert_rejected(client, MALFORMED[name][0], name)


def test_duplicate_active_request_id_is_already_exists_then_reusable(served):
    _, client, channel = served
    long = _req(request_id="dup-1", max_tokens=4000, temperature=0.0, ignore_eos=True)
    first = raw_generate(channel)(long.SerializeToString(), timeout=120)
    assert next(iter(first))  # streaming: "dup-1" is active now
    code, detail = first_answer(channel, long.SerializeToString())
    assert code == "ALREADY_EXISTS" and "dup-1" in detail
    first.cancel()
    end = time.monotonic() + 30
    while client.stats().num_inflight and time.monotonic() < end:
        time.sleep(0.05)
    assert first_answer(channel, _req(request_id="dup-1", max_tokens=2).SerializeToString()
                        )[0] == "OK"


def test_tiny_positive_temperature_is_served_or_rejected(served):
    _, _, channel = served
    code, detail = first_answer(channel, _req(temperature=1e-300, max_tokens=3).SerializeToString())
    assert code in ("OK", "INVALID_ARGUMENT"), (code, detail)


def test_after_the_storm_exact_tokens_and_nothing_held(served, tiny_model):
    _, client, _ = served
    prompt = list(range(3, 40))
    got = client.complete(prompt, max_tokens=10, temperature=0.0, ignore_eos=True)
    want = LLM(str(tiny_model)).generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True))[0].token_ids
    assert list(got.token_ids) == want
    end = time.monotonic() + 60
    while True:
        st_ = client.stats()
        w = st_.workers[0]
        idle = (w.kv_blocks_used, w.num_running, w.num_waiting, st_.num_inflight) == (0, 0, 0, 0)
        if idle or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert idle, st_
