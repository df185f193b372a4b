"""The front door's StreamWriter (cluster/router/delta_stream.py) and the pump's inline token
path (cluster/router/events.py on_batch with a byte-table tokenizer): a stream's common
messages go out from the put that brings them, one write in flight at a time, what comes
meanwhile coalesced into the next; the reader keeps the first and last messages, aborts
and errors; and through real gRPC the client gets exactly the tokens and the text of a
whole decode, with a leak check after."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable

import pytest

from cluster.config.serve import ServeConfig
from cluster.grpc.client import PdserveClient
from cluster.router.delta_stream import DeltaStream, StreamWriter
from cluster.router.types import TokenDelta
from cluster.serve.server import BackgroundServer
from engine.detokenize import BatchDecoder, IncrementalDetokenizer
from engine.loader import load_tokenizer
from runtime.batch_codec import decode_batch, encode_batch
from runtime.messages import EventKind, WorkerEvent
from tests.scripted_workers import make_router
from tests.unit.test_router_races import assert_router_clean


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


class Wire:
    """A write() like grpc.aio's: each message waits on a Future the test completes."""

    def __init__(self):
        self.sent: list = []
        self.pending: list[asyncio.Future] = []
        self.in_flight = self.most_in_flight = 0

    async def write(self, message) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        try:
            await fut
        finally:
            self.in_flight -= 1
        self.sent.append(message)

    def complete(self, error: Exception | None = None) -> None:
        fut = self.pending.pop(0)
        fut.set_exception(error) if error else fut.set_result(None)


def run_writer(body: Callable[[DeltaStream, Wire, StreamWriter], Awaitable[None]]) -> None:
    """Run `await body(stream, wire, writer)` in a fresh event loop: a new stream, and its
    writer, which writes each message to `wire` as (token ids, text)."""
    async def go() -> None:
        stream, wire = DeltaStream("r"), Wire()
        await body(stream, wire,
                   StreamWriter(stream, wire.write, lambda ids, text: (tuple(ids), text)))

    asyncio.run(go())


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_tokens_go_out_at_once_one_write_in_flight_the_rest_coalesced():
    async def go(s: DeltaStream, wire: Wire, w: StreamWriter) -> None:
        s.put_text([1], "a")  # out at once: the reader is not woken
        assert len(wire.pending) == 1 and len(s) == 0
        s.put_text([2], "b")
        s.put([3], "c")  # both wait behind the write in flight
        assert len(wire.pending) == 1 and len(s) == 2
        wire.complete()
        await _turns()
        assert wire.sent == [((1,), "a")] and len(wire.pending) == 1 and len(s) == 0
        wire.complete()
        await _turns()
        assert wire.sent == [((1,), "a"), ((2, 3), "bc")] and not wire.pending
        assert wire.most_in_flight == 1 and not w.closed and s.empty()

    run_writer(go)


def test_the_last_delta_goes_to_the_reader_with_what_waited_after_the_write_in_flight():
    async def go(s: DeltaStream, wire: Wire, w: StreamWriter) -> None:
        s.put_text([1], "a")
        s.put_text([2], "b")
        s.put([3], "c", last=TokenDelta("r", (), True, "length"))
        d = await asyncio.wait_for(s.get(), 5)  # the reader's: leftovers and the end
        assert (d.token_ids, d.text, d.finished, d.finish_reason) == ((2, 3), "bc", True,
                                                                      "length")
        paused = asyncio.ensure_future(w.pause())
        await _turns()
        assert not paused.done()  # the write in flight goes out first
        wire.complete()
        await asyncio.wait_for(paused, 5)
        assert wire.sent == [((1,), "a")] and s.take_common() is None

    run_writer(go)


def test_a_paused_writer_holds_its_tokens_until_resumed():
    async def go(s: DeltaStream, wire: Wire, w: StreamWriter) -> None:
        await w.pause()
        s.put_text([1], "a")
        assert not wire.pending and len(s) == 1  # (the reader writes meanwhile)
        w.resume()
        assert len(wire.pending) == 1 and len(s) == 0
        wire.complete()
        await _turns()
        assert wire.sent == [((1,), "a")]

    run_writer(go)


def test_a_failed_write_detaches_the_writer_and_the_reader_gets_the_rest():
    async def go(s: DeltaStream, wire: Wire, w: StreamWriter) -> None:
        s.put_text([1], "a")
        reader = asyncio.ensure_future(s.get())
        await _turns()
        assert not reader.done()
        wire.complete(RuntimeError("the call ended"))
        await _turns()
        assert w.closed and s.sink is None and not reader.done()
        s.put_text([2], "b")
        d = await asyncio.wait_for(reader, 5)
        assert (d.token_ids, d.text) == ((2,), "b") and not wire.sent

    run_writer(go)


def test_push_text_gives_push_bytes_deltas(tokenizer):
    d = BatchDecoder(tokenizer)
    ids = tokenizer("héllo wörld ✓ 日本語 \U0001f600! and plain words").input_ids
    ids += [tokenizer.eos_token_id, len(tokenizer) + 3, *ids[:5]]
    fast, slow = IncrementalDetokenizer(), IncrementalDetokenizer()
    assert [d.push_text(fast, [t]) for t in ids] == [
        slow.push_bytes(d._table, [t], False) for t in ids]
    assert d.push_text(fast, ids[2:6]) == slow.push_bytes(d._table, ids[2:6], False)


def test_streams_through_grpc_carry_every_token_and_the_whole_text(tokenizer):
    """Real gRPC, a Router over scripted workers with the tiny model's byte-level
    tokenizer: decode steps reach the pump as a channel delivers them (on_batch), the
    first message goes through the reader and the rest through the writer, one message
    per step (each step waits for the client to read the last); the text joins to the
    whole decode and multi-byte characters split across tokens are never cut."""
    router, prefill, [decode] = make_router()
    router.tokenizer = tokenizer
    ids = tokenizer("héllo wörld ✓ 日本語 \U0001f600!").input_ids
    legs: list[str] = []

    async def on_add(task):
        legs.append(task.leg_id)

    prefill.handle.on_add = on_add
    srv = BackgroundServer(router, ServeConfig().with_values({"server.port": 0}))
    srv.start()
    client = PdserveClient(srv.address, timeout=30)
    got: list[queue.Queue] = [queue.Queue(), queue.Queue()]

    def read(i: int) -> None:
        for chunk in client.generate([5, 6, 7], max_tokens=len(ids), request_id=f"s{i}"):
            got[i].put(chunk)

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]

    async def step(worker, kind: EventKind, k: int) -> None:
        last = k == len(ids) - 1
        events = [WorkerEvent(kind, leg, worker.worker_id, (ids[k],),
                              finish_reason="length" if last else None) for leg in legs]
        if k == 0:  # (as FakeActor.emit: what a worker reports ends its part there)
            events += [WorkerEvent(EventKind.PREFILL_DONE, leg, worker.worker_id)
                       for leg in legs]
        if k == 0 or last:
            worker.actor.held.difference_update(legs)
        router.pump.on_batch(worker, *decode_batch(encode_batch(worker.worker_id, events,
                                                                None))[1:])

    try:
        for t in readers:
            t.start()
        srv.run(_until(lambda: len(legs) == 2))
        chunks: list[list] = [[], []]
        for k in range(len(ids)):
            srv.run(step(prefill if k == 0 else decode, EventKind.FIRST_TOKEN if k == 0
                         else EventKind.TOKENS, k))
            for i in range(2):
                chunks[i].append(got[i].get(timeout=30))
            if k == 1:  # the second message on came through a writer
                assert all(isinstance(f.queue.sink.__self__, StreamWriter)
                           for f in router.flights.values())
        for t in readers:
            t.join(30)
        want = tokenizer.decode(ids, skip_special_tokens=True)
        for cs in chunks:
            assert [t for c in cs for t in c.token_ids] == ids
            assert "".join(c.text for c in cs) == want
            assert len(cs) == len(ids) and cs[-1].finish_reason == "length"
            assert "\ufffd" not in "".join(c.text for c in cs)
        srv.run(_until(lambda: not router.flights))
        assert_router_clean(router, prefill, [decode])
    finally:
        client.close()
        srv.stop(drain_timeout_s=0)


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.002)
