"""The gRPC door under pressure, over the scripted FakeRouter of test_front_door: a
request id is free the moment its request ends (any status), one status per rejected
call (no second context.abort), prompt size checked before tokenizing, tokenizing off
the event loop, bounded stop_token_ids."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.grpc.convert import build_request
from cluster.grpc.servicer import GenerationServicer, ServingState
from cluster.serve.server import BackgroundServer
from engine.validation import MAX_STOP_TOKEN_IDS
from tests.unit.test_front_door import FakeRouter, _wait


@pytest.fixture
def door():
    router = FakeRouter()
    cfg = ServeConfig().with_values({"server.port": 0, "limits.request_timeout_s": 1.0,
                                     "limits.max_prompt_bytes": 64})
    srv = BackgroundServer(router, cfg, health_poll_s=0.02)
    srv.start()
    client = PdserveClient(srv.address, timeout=20)
    yield router, srv, client
    router.tokenize_gate.set()
    client.close()
    srv.stop(drain_timeout_s=0)


class FakeContext:
    """Fails like grpc.aio's: abort() raises; a second abort is a usage error."""

    def __init__(self):
        self.aborts: list[tuple[grpc.StatusCode, str]] = []
        self.is_cancelled = False

    async def abort(self, code, details=""):
        self.aborts.append((code, details))
        raise grpc.aio.AbortError()

    def peer(self) -> str:
        return "test"

    def cancelled(self) -> bool:
        return self.is_cancelled


@pytest.mark.parametrize(("prompt", "code"), [
    ("early", grpc.StatusCode.INTERNAL),  # the backend ended without a final delta
    ("boom", grpc.StatusCode.INTERNAL),  # a backend bug
    ("error:RESOURCE_EXHAUSTED", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_a_failed_call_aborts_its_context_exactly_once(prompt, code):
    async def go():
        servicer = GenerationServicer(FakeRouter(), ServingState())
        ctx = FakeContext()
        with pytest.raises(grpc.aio.AbortError):
            async for _ in servicer.Generate(build_request(prompt), ctx):
                pass
        return ctx.aborts, servicer.state

    aborts, state = asyncio.run(go())
    assert [c for c, _ in aborts] == [code]
    assert not state.active


ENDINGS = ["finished", "abort-rpc", "deadline", "router-error", "invalid", "client-cancel"]


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_request_id_is_free_once_its_request_ended(door, ending):
    router, srv, client = door
    rid = f"id-{ending}"
    if ending == "finished":
        assert client.complete("hi", request_id=rid).finish_reason == "stop"
    elif ending == "abort-rpc":  # reused as soon as Abort returns; the old stream lingers
        it = iter(client.generate("linger", request_id=rid))
        next(it)
        assert client.abort(rid) is True
    elif ending == "client-cancel":
        stream = client.generate("hang", request_id=rid)
        next(iter(stream))
        stream.cancel()
    else:
        prompt = {"deadline": "hang", "router-error": "error:RESOURCE_EXHAUSTED",
                  "invalid": "x" * 65}[ending]
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate(prompt, request_id=rid))
        assert e.value.code() == {"deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "router-error": grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  "invalid": grpc.StatusCode.INVALID_ARGUMENT}[ending]
    again = client.complete("ok", request_id=rid)
    assert again.text == "ok" and again.finish_reason == "stop"
    if ending == "abort-rpc":
        srv.loop.call_soon_threadsafe(router.linger.set)
        assert list(it)[-1].finish_reason == "abort"
    assert _wait(lambda: not srv.server.state.active)


def test_reuse_right_after_a_client_cancel_waits_for_the_old_call_to_be_freed():
    """The client cancelled; its call is still freeing the request in the backend (a slow
    abort) when the same id comes again: the new call waits for that, then is served."""
    async def go():
        router = FakeRouter()
        router.abort_gate = asyncio.Event()
        servicer = GenerationServicer(router, ServingState())
        old_ctx, new_ctx = FakeContext(), FakeContext()
        old = servicer.Generate(build_request("hang", request_id="r"), old_ctx)
        assert list((await old.__anext__()).token_ids) == [65]
        old_ctx.is_cancelled = True  # what grpc does when the client cancels...
        old_task = asyncio.ensure_future(old.__anext__())  # ...then cancels the handler
        await asyncio.sleep(0)
        old_task.cancel()
        while "r" not in router.aborted:  # the old call is now inside its abort
            await asyncio.sleep(0)
        new = servicer.Generate(build_request(list(b"ok"), request_id="r"), new_ctx)
        first = asyncio.ensure_future(new.__anext__())
        for _ in range(20):
            await asyncio.sleep(0)
        waited = not first.done()
        router.abort_gate.set()
        got = [list((await first).token_ids)] + [list(r.token_ids) async for r in new]
        with pytest.raises(asyncio.CancelledError):
            await old_task
        return waited, got, new_ctx.aborts, servicer.state

    waited, got, aborts, state = asyncio.run(go())
    assert waited and aborts == []
    assert got == [[111], [107]]
    assert not state.active


def test_an_id_in_flight_is_refused_and_the_first_call_goes_on(door):
    router, _, client = door
    it = iter(client.generate("hang", request_id="twice"))
    next(it)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("hi", request_id="twice"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert client.abort("twice") is True
    assert list(it)[-1].finish_reason == "abort"


def test_a_text_prompt_over_max_prompt_bytes_is_refused_before_tokenizing(door):
    router, _, client = door
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("é" * 33))  # 33 characters, 66 bytes of UTF-8 > 64
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt.text" in e.value.details() and "max_prompt_bytes" in e.value.details()
    assert router.tokenized == []
    assert client.complete("é" * 20).finish_reason == "stop"  # 40 bytes: served


def test_tokenizing_runs_off_the_event_loop(door):
    """While a text prompt is being tokenized, the server keeps answering other calls."""
    router, _, client = door
    result = {}
    t = threading.Thread(target=lambda: result.update(out=client.complete("gated prompt")))
    t.start()
    assert _wait(lambda: router.tokenized == ["gated prompt"])
    stats = client.stats()  # served by the event loop while tokenize() is blocked
    blocked = t.is_alive() and not router.tokenize_gate.is_set()
    router.tokenize_gate.set()
    t.join(20)
    assert stats.workers and blocked
    assert result["out"].text == "gated prompt"


def test_stop_token_ids_are_bounded(door):
    router, _, client = door
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("hi", stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop_token_ids" in e.value.details()
    ok = client.complete("hi", stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    assert ok.finish_reason == "stop" and router.specs[-1].sampling.stop_token_ids[0] == 1


def test_the_proto_documents_the_limits_the_door_enforces():
    from pathlib import Path

    from cluster.grpc.intake import DEFAULT_MAX_PROMPT_BYTES

    proto = (Path(__file__).parents[2] / "proto/pdserve/v1/pdserve.proto").read_text()
    stop = proto[proto.index("repeated int32 stop_token_ids"):]
    assert f"at most {MAX_STOP_TOKEN_IDS}" in stop[:200]
    assert DEFAULT_MAX_PROMPT_BYTES == 1 << 20 and "(default 1 MiB)" in proto
    assert "free again at once" in proto  # the request-id contract
