"""RouterAPI.stream: the one way a front door reaches a request's stream. The Router
hands out a live request's DeltaStream (None for an unknown or ended id), and the gRPC
servicer takes the common messages over through it with nothing else of the router's
(a router that exposes only RouterAPI's names still gets its writer)."""

from __future__ import annotations

import asyncio

from cluster.grpc.convert import build_request
from cluster.grpc.servicer import GenerationServicer, ServingState
from cluster.router.delta_stream import DeltaStream
from cluster.router.types import GenerateSpec, RouterAPI
from engine import SamplingParams
from proto.pdserve.v1 import pdserve_pb2 as pb
from runtime.messages import EventKind
from tests.scripted_workers import collect, make_router, until
from tests.unit.test_router_races import assert_router_clean

API = {n for n in dir(RouterAPI) if not n.startswith("_")} | set(RouterAPI.__annotations__)


class OnlyTheAPI:
    """A router seen through RouterAPI alone: any other attribute is an error."""

    def __init__(self, router):
        self._router = router

    def __getattr__(self, name: str):
        if name not in API:
            raise AttributeError(f"{name!r} is not part of RouterAPI")
        return getattr(self._router, name)


class LetterTokenizer:
    @staticmethod
    def decode(ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class WritingContext:
    """A grpc.aio context that records what is written to it beside the handler's yields."""

    def __init__(self):
        self.written: list = []

    async def write(self, message) -> None:
        self.written.append(message)

    async def abort(self, code, details=""):
        raise AssertionError(f"aborted: {code} {details}")

    def peer(self) -> str:
        return "test"

    def cancelled(self) -> bool:
        return False


def test_stream_is_the_live_requests_delta_stream_and_none_once_it_ended():
    async def go():
        router, prefill, [decode] = make_router()
        legs: list[str] = []

        async def on_add(task):
            legs.append(task.leg_id)

        prefill.handle.on_add = on_add
        spec = GenerateSpec("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=3))
        reader = asyncio.ensure_future(collect(router.generate(spec)))
        await until(lambda: legs, "the prefill add")
        stream = router.stream("r")
        assert isinstance(stream, DeltaStream) and stream.request_id == "r"
        assert router.stream("other") is None
        prefill.actor.emit(EventKind.FIRST_TOKEN, legs[0], (7,))
        prefill.actor.emit(EventKind.PREFILL_DONE, legs[0])
        decode.actor.emit(EventKind.TOKENS, legs[0], (8, 9), finish_reason="length")
        assert await asyncio.wait_for(reader, 10) == [7, 8, 9]
        assert router.stream("r") is None  # the id is free: no stream of the old request
        await router.shutdown(0)
        return router, prefill, decode

    router, prefill, decode = asyncio.run(go())
    assert_router_clean(router, prefill, [decode])


def test_the_servicer_takes_the_stream_over_through_router_api_alone():
    async def go():
        router, prefill, [decode] = make_router()
        router.tokenizer = LetterTokenizer()
        legs: list[str] = []

        async def on_add(task):
            legs.append(task.leg_id)

        prefill.handle.on_add = on_add
        servicer = GenerationServicer(OnlyTheAPI(router), ServingState())
        ctx = WritingContext()
        call = servicer.Generate(build_request([1, 2, 3], request_id="g", max_tokens=4,
                                               ignore_eos=True), ctx)
        first = asyncio.ensure_future(call.__anext__())
        await until(lambda: legs, "the prefill add")
        prefill.actor.emit(EventKind.FIRST_TOKEN, legs[0], (7,))
        prefill.actor.emit(EventKind.PREFILL_DONE, legs[0])
        yielded = [await asyncio.wait_for(first, 10)]  # the first message: the handler's
        rest = asyncio.ensure_future(collect_messages(call))
        await until(lambda: router.stream("g") is not None and router.stream("g").sink,
                    "the writer took the stream over")
        decode.actor.emit(EventKind.TOKENS, legs[0], (8,))
        await until(lambda: ctx.written, "a message written beside the handler")
        decode.actor.emit(EventKind.TOKENS, legs[0], (9, 10), finish_reason="length")
        yielded += await asyncio.wait_for(rest, 10)
        await router.shutdown(0)
        return router, prefill, decode, yielded, ctx.written

    router, prefill, decode, yielded, written = asyncio.run(go())
    written = [pb.GenerateResponse.FromString(m) for m in written]  # (encoded once)
    assert [list(m.token_ids) for m in written] == [[8]]  # the writer's, through stream()
    assert written[0].request_id == "g" and written[0].text == "i"
    assert [t for m in yielded for t in m.token_ids] == [7, 9, 10]
    assert_router_clean(router, prefill, [decode])


async def collect_messages(call) -> list:
    return [m async for m in call]
