"""The gRPC server over a scripted fake RouterAPI: error mapping, aborts, deadlines,
health and UTF-8-safe text deltas, without a model."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.router.types import (
    ClusterStats,
    ErrorCode,
    RouterError,
    TokenDelta,
    Usage,
    WorkerStats,
)
from cluster.serve.server import BackgroundServer
from engine.detokenize import IncrementalDetokenizer


class FakeRouter:
    """Tokens are UTF-8 bytes. Prompts script the behaviour (see generate)."""

    vocab_size = 256
    max_model_len = 64

    def __init__(self):
        self.specs, self.aborted, self.is_healthy, self.shut_down = [], [], True, False
        self._hung: dict[str, asyncio.Event] = {}
        self.tokenized: list[str] = []
        self.tokenize_gate = threading.Event()  # "gated..." texts tokenize once it is set
        self.linger = asyncio.Event()  # "linger": after an abort, the stream ends once set
        self.abort_gate: asyncio.Event | None = None  # set: abort() returns once it is set

    def tokenize(self, text: str) -> list[int]:
        self.tokenized.append(text)
        if text.startswith("gated"):
            assert self.tokenize_gate.wait(10), "the tokenize gate was never opened"
        return list(text.encode())

    def detokenize(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    async def generate(self, spec):
        self.specs.append(spec)
        text = self.detokenize(list(spec.prompt_token_ids))
        if text.startswith("error:"):
            raise RouterError(ErrorCode[text[6:]], f"scripted {text[6:]}")
        if text == "boom":
            raise RuntimeError("backend bug")
        if text == "early":
            yield TokenDelta(spec.request_id, (65,))
            return
        if text in ("hang", "linger"):  # like the P/D router: abort -> RouterError(CANCELLED)
            self._hung[spec.request_id] = event = asyncio.Event()
            yield TokenDelta(spec.request_id, (65,))
            await event.wait()
            if text == "linger":  # a backend that takes a while to end the stream
                await self.linger.wait()
            raise RouterError(ErrorCode.CANCELLED, "aborted by the client")
        ids = spec.prompt_token_ids
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            yield TokenDelta(spec.request_id, (t,), last, "stop" if last else None,
                             Usage(prompt_tokens=len(ids), completion_tokens=len(ids)) if last
                             else None)

    def stream(self, request_id: str) -> None:  # the handler writes every message
        return None

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        if self.abort_gate is not None:
            await self.abort_gate.wait()
        event = self._hung.pop(request_id, None)
        if event is not None:
            event.set()
        return event is not None

    async def stats(self) -> ClusterStats:
        return ClusterStats((WorkerStats("fake-0", "decode", True, extra={"x": 1.5}),))

    def healthy(self) -> bool:
        return self.is_healthy

    async def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        self.shut_down = True


@pytest.fixture
def fake():
    router = FakeRouter()
    cfg = ServeConfig().with_values({"server.port": 0, "limits.request_timeout_s": 1.0,
                                     "limits.max_prompt_tokens": 40})
    srv = BackgroundServer(router, cfg, health_poll_s=0.02)
    srv.start()
    client = PdserveClient(srv.address, timeout=20)
    yield router, srv, client
    client.close()
    srv.stop(drain_timeout_s=0)


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_text_deltas_hold_back_incomplete_utf8(fake):
    _, _, client = fake
    text = "héllo wörld ✓"
    chunks = list(client.generate(text))
    assert "".join(c.text for c in chunks) == text
    assert not any("\ufffd" in c.text for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == list(text.encode())
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.prompt_tokens == len(text.encode())


def test_detokenizer_matches_a_full_decode_at_the_end():
    decode = FakeRouter().detokenize
    d = IncrementalDetokenizer(decode)
    data = "a€b".encode() + b"\xe2\x82"  # ends in a truncated character
    parts = [d.push([b]) for b in data[:-1]] + [d.push([data[-1]], final=True)]
    assert "".join(parts) == decode(list(data))


@pytest.mark.parametrize("code", ["RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                                  "ALREADY_EXISTS", "INTERNAL", "INVALID_ARGUMENT"])
def test_router_errors_map_to_grpc_status(fake, code):
    _, _, client = fake
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(f"error:{code}"))
    assert e.value.code() == getattr(grpc.StatusCode, code)
    assert f"scripted {code}" in e.value.details()


def test_backend_bugs_are_internal_and_the_server_survives(fake):
    _, _, client = fake
    for prompt in ("boom", "early"):
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate(prompt))
        assert e.value.code() == grpc.StatusCode.INTERNAL
    assert client.complete("ok").text == "ok"


def test_spec_carries_scheduling_fields_and_limits(fake):
    router, _, client = fake
    client.complete("hi", tenant="gold", priority=3, ttft_deadline_ms=250.0, seed=5,
                    stop_token_ids=[10], request_id="r-1")
    client.complete("hi")
    a, b = router.specs[-2:]
    assert (a.request_id, a.tenant, a.priority, a.ttft_deadline_ms) == ("r-1", "gold", 3, 250.0)
    assert a.sampling.seed == 5 and a.sampling.stop_token_ids == (10,)
    assert b.tenant == "default" and b.ttft_deadline_ms is None and b.request_id.startswith("req-")
    with pytest.raises(grpc.RpcError) as e:  # limits.max_prompt_tokens = 40
        list(client.generate("x" * 41))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_prompt_tokens" in e.value.details()


def test_abort_rpc_ends_a_cancelled_router_stream_with_finish_abort(fake):
    router, _, client = fake
    it = iter(client.generate("hang", request_id="h-1"))
    next(it)
    assert client.abort("h-1") is True
    rest = list(it)
    assert rest[-1].finish_reason == "abort"
    assert "h-1" in router.aborted


def test_request_timeout_aborts_in_the_router(fake):
    router, _, client = fake
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("hang", request_id="slow"))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "slow" in router.aborted


def test_client_cancel_aborts_in_the_router(fake):
    router, _, client = fake
    stream = client.generate("hang", request_id="gone")
    it = iter(stream)
    next(it)
    stream.cancel()
    assert _wait(lambda: "gone" in router.aborted)


def test_health_follows_router_health_and_stats_convert(fake):
    router, _, client = fake
    assert client.health() == "SERVING"
    router.is_healthy = False
    assert _wait(lambda: client.health() == "NOT_SERVING")
    router.is_healthy = True
    assert _wait(lambda: client.health() == "SERVING")
    s = client.stats()
    assert s.workers[0].worker_id == "fake-0" and s.workers[0].extra == {"x": 1.5}


def test_drain_timeout_aborts_stragglers_then_shuts_the_router_down(fake):
    router, srv, client = fake
    it = iter(client.generate("hang", request_id="straggler"))
    next(it)
    srv.stop(drain_timeout_s=0.2)
    assert list(it)[-1].finish_reason == "abort"
    assert router.shut_down
