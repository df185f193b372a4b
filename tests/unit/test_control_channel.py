"""The worker's control channel (runtime/channel.py) against the front door's side
(cluster/router/channel.py) over real sockets: the HMAC handshake, commands run in order
with results and exceptions returned, one message per step routed to the link that
created each leg, load updates, a lost link failing its calls, and no routing entry left
once every leg ended (the channel's leak check)."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from concurrent.futures import Future

import pytest

from cluster.router.channel import ChannelActor, WorkerChannel, _open
from engine.request import FinishReason, SamplingParams
from kv_transfer.tcp_auth import AuthError
from runtime.batch_codec import decode_batch, encode_batch, entry_event
from runtime.channel import (
    DIRECT_MAX_EVENTS,
    KIND_CALL,
    KIND_EVENTS,
    KIND_REPLY,
    ChannelServer,
    frame,
    read_frame,
)
from runtime.loop import WorkerLoop
from runtime.messages import EventKind, LegTiming, PrefillTask, WorkerEvent, WorkerLoad

SECRET = b"s" * 32


def _task(leg: str) -> PrefillTask:
    return PrefillTask(leg, (1, 2, 3), SamplingParams(max_tokens=4), "fake://d")


class Worker:
    """Commands recorded in order; `add` answers through a Future like the loop does."""

    def __init__(self):
        self.calls: list = []
        self.load = WorkerLoad(kv_blocks_used=3, kv_blocks_promisable=7)

    def commands(self):
        def add(task):
            self.calls.append(("add", task.leg_id))
            f: Future = Future()
            f.set_result(None)
            return f

        def reserve(task):
            raise ValueError(f"leg {task.leg_id!r} cannot fit")

        return {"hello": lambda: "w0", "add": add, "reserve": reserve,
                "abort": lambda leg: self.calls.append(("abort", leg)) or True}

    def server(self) -> ChannelServer:
        return ChannelServer("w0", "prefill", SECRET, self.commands(),
                             load=lambda: self.load)


async def _connect(server: ChannelServer, batches: list, secret: bytes = SECRET):
    return await WorkerChannel.connect("w0", f"127.0.0.1:{server.port}", secret, "test",
                                       lambda load, entries: batches.append((load, entries)))


async def _until(cond, what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def test_commands_run_in_order_and_events_reach_the_link_that_made_the_leg():
    w = Worker()
    srv = w.server()

    async def go():
        mine, other = [], []
        a, b = await _connect(srv, mine), await _connect(srv, other)
        await asyncio.gather(*(a.call("add", _task(f"leg{i}")) for i in range(5)))
        await b.call("add", _task("b-leg"))
        with pytest.raises(ValueError, match="cannot fit"):  # the worker's exception, typed
            await a.call("reserve", _task("x"))
        srv.publish([WorkerEvent(EventKind.FIRST_TOKEN, "leg0", "w0", (9,),
                                 timing=LegTiming(queue_s=0.5)),
                     WorkerEvent(EventKind.FIRST_TOKEN, "b-leg", "w0", (4,)),
                     WorkerEvent(EventKind.FIRST_TOKEN, "nobody", "w0", (1,))])
        await _until(lambda: mine and other, "both links got the step")
        assert srv.legs == 6
        for i in range(5):  # each leg ends here: its routing entry goes
            srv.publish([WorkerEvent(EventKind.PREFILL_DONE, f"leg{i}", "w0")])
        srv.publish([WorkerEvent(EventKind.FAILED, "b-leg", "w0", message="boom")])
        await _until(lambda: srv.legs == 0, "every leg forgotten")
        a.close(), b.close()
        return mine, other

    mine, other = asyncio.run(go())
    srv.close()
    assert w.calls == [("add", f"leg{i}") for i in range(5)] + [("add", "b-leg")]
    load, entries = mine[0]
    assert load == WorkerLoad(kv_blocks_used=3, kv_blocks_promisable=7)
    ev = entry_event("w0", entries[0])  # only its own leg, with its timing
    assert [e[1] for e in entries] == ["leg0"] and ev.token_ids == (9,)
    assert ev.timing.queue_s == 0.5
    assert [e[1] for e in other[0][1]] == ["b-leg"]


def test_load_reaches_an_idle_link_and_a_wrong_secret_is_refused():
    w = Worker()
    srv = w.server()

    async def go():
        got = []
        ch = await _connect(srv, got)
        # the server admits the link on its own thread, and subscribes it once the link
        # spoke: a publish before that has nobody to send to (the worker's loop publishes
        # every step; this test publishes once)
        await _until(lambda: srv._links and all(k.subscribed for k in srv._links),
                     "the link subscribed")
        w.load = WorkerLoad(kv_blocks_used=5)
        srv.idle = lambda: True  # the worker went idle: its last load goes out at once
        srv.publish([])
        await _until(lambda: got, "a load-only message")
        with pytest.raises(AuthError):
            await _connect(srv, [], secret=b"x" * 32)
        ch.close()
        return got

    got = asyncio.run(go())
    srv.close()
    assert got[0] == (WorkerLoad(kv_blocks_used=5), [])


class WaitingEngine:
    """A decode engine whose reserved legs wait for KV that never comes: it has work but
    no step runs (WorkerLoop's engine protocol)."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.last_step_ran = False

    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[WorkerEvent]:
        return []

    def fail_all(self, message: str) -> list[WorkerEvent]:
        return []

    def load(self) -> WorkerLoad:
        return WorkerLoad(kv_blocks_promisable=100 - 10 * len(self.pending))


def test_a_reserve_on_a_worker_waiting_for_kv_sends_its_load_with_no_step_running():
    # the router places on the load of the last message: a reserve on a worker whose legs
    # wait for KV runs no step, and its load must still go out (else the next request sees
    # the worker as free and queues behind that leg's transfer) -- at once, even right
    # after another message, since no step is running to carry it later
    eng = WaitingEngine()
    srv = ChannelServer("w0", "decode", SECRET, {
        "hello": lambda: "w0",
        "reserve": lambda task: loop.submit(lambda: eng.pending.append(task.leg_id) or True)},
        load=eng.load, idle=lambda: not eng.last_step_ran)
    loop = WorkerLoop(eng, on_events=srv.publish, every_step=True)

    async def go():
        got: list = []
        ch = await _connect(srv, got)
        await _until(lambda: srv._links and all(k.subscribed for k in srv._links),
                     "the link subscribed")
        assert await ch.call("reserve", _task("a")) is True
        await _until(lambda: any(ld.kv_blocks_promisable == 90 for ld, _ in got), "load 90")
        assert await ch.call("reserve", _task("b")) is True  # within LOAD_PERIOD_S
        await _until(lambda: any(ld.kv_blocks_promisable == 80 for ld, _ in got), "load 80")
        ch.close()
        return got

    try:
        got = asyncio.run(go())
    finally:
        loop.stop()
        srv.close()
    assert all(entries == [] for _, entries in got)  # load-only messages


def test_a_lost_link_fails_its_pending_calls_and_the_actor_wrapper_routes_commands():
    w = Worker()
    blocked: Future = Future()
    cmds = w.commands()
    cmds["add"] = lambda task: blocked  # never answered
    srv = ChannelServer("w0", "decode", SECRET, cmds)

    async def go():
        ch = await _connect(srv, [])
        holder = type("Handle", (), {"link": ch})()
        actor = ChannelActor(ray_actor=type("Ray", (), {"ping": "ray-side"})(), holder=holder)
        pending = actor.add.remote(_task("leg"))  # sent at once, even if never awaited
        await _until(lambda: srv.legs == 1, "the add arrived")
        assert actor.ping == "ray-side"  # everything else goes to the Ray actor
        srv.close()  # the worker goes away
        with pytest.raises(ConnectionError):
            await pending
        assert ch.lost.done()
        with pytest.raises(ConnectionError):
            await actor.abort.remote("leg")

    asyncio.run(go())
    assert srv.legs == 0


def test_the_step_codec_round_trips_every_field():
    evs = [WorkerEvent(EventKind.TOKENS, "a#1", "w", (1, 2), FinishReason.LENGTH, "",
                       12.5, LegTiming(decode_s=0.25)),
           WorkerEvent(EventKind.PREEMPTED, "b#1", "w", message="out of KV blocks")]
    wid, load, entries = decode_batch(encode_batch("w", evs, WorkerLoad(num_running=2)))
    assert wid == "w" and load == WorkerLoad(num_running=2)
    assert [entry_event("w", e) for e in entries] == evs


def test_optional_per_token_extras_travel_in_their_entry(monkeypatch):
    """An optional WorkerEvent field registered in EXTRAS (as log-probabilities would be)
    rides in its own entry, converted to plain data and back; entries without it stay
    plain (the router's hot path)."""
    from dataclasses import dataclass

    import runtime.batch_codec as codec

    @dataclass
    class Scored(WorkerEvent):
        scores: tuple[tuple[int, float], ...] | None = None

    monkeypatch.setattr(codec, "EXTRAS", {"scores": (
        lambda v: [list(x) for x in v], lambda rows: tuple(tuple(r) for r in rows))})
    monkeypatch.setattr(codec, "WorkerEvent", Scored)
    evs = [Scored(EventKind.TOKENS, "a#1", "w", (5,), scores=((5, -0.25),)),
           Scored(EventKind.TOKENS, "b#1", "w", (6,))]
    _, _, entries = decode_batch(encode_batch("w", evs, None))
    assert entries[0][7] == {"scores": [[5, -0.25]]} and entries[1][7] is None
    assert [entry_event("w", e) for e in entries] == evs


def test_a_link_is_registered_before_its_threads_serve_it(monkeypatch):
    """A front door may send commands (and get their replies) as soon as the link's
    reader runs: the link must be in the server's list by then, or a step message for
    its legs, and close(), would miss it (a race that lost a test's events under load)."""
    w = Worker()
    srv = w.server()
    links_at_start = []
    start = threading.Thread.start

    def recording_start(thread):
        if thread.name.startswith("channel-reader"):
            links_at_start.append(len(srv._links))
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)

    async def go():
        ch = await _connect(srv, [])
        ch.close()

    asyncio.run(go())
    srv.close()
    assert links_at_start == [1]


def test_a_front_door_that_stops_reading_never_blocks_the_publisher_and_loses_nothing():
    """Step messages go out from the publishing thread while the socket takes them; once
    the peer stops reading they queue for the link's writer (publish returns at once),
    and when it reads again every message arrives whole and in order."""
    w = Worker()
    srv = w.server()
    sock = _open(f"127.0.0.1:{srv.port}", SECRET, "slow")
    try:
        sock.sendall(frame(KIND_CALL, pickle.dumps((0, "add", (_task("leg"),)))))
        for _ in range(2000):
            if srv.legs == 1:
                break
            time.sleep(0.005)
        assert srv.legs == 1
        tokens = tuple(range(100_000))  # ~300 KB a message: the socket buffers fill up
        n = 64
        big = DIRECT_MAX_EVENTS + 1  # step 1 is a big one: it always goes to the writer
        for i in range(n):
            srv.publish([WorkerEvent(EventKind.FIRST_TOKEN, "leg", "w0", (i, *tokens))] *
                        (big if i == 1 else 1))
        (link,) = srv._links
        assert link._queued > 0  # the peer reads nothing: the writer holds the rest
        kind, _ = read_frame(sock)
        assert kind == KIND_REPLY
        got = []
        for i in range(n):
            kind, body = read_frame(sock)
            assert kind == KIND_EVENTS
            _, _, entries = decode_batch(body)
            got.append(entries[0][2][0])
            assert len(entries) == (big if i == 1 else 1)
            assert all(len(e[2]) == len(tokens) + 1 for e in entries)
        assert got == list(range(n))
    finally:
        sock.close()
        srv.close()


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
def test_a_link_that_ends_aborts_the_legs_it_created_and_no_other(transport):
    """Their front door is gone (or re-dispatched them when it lost the link): nobody
    reads or ends them any more. Over TCP and over the in-process link alike."""
    w = Worker()
    srv = ChannelServer("w0", "prefill", SECRET if transport == "tcp" else b"", w.commands())
    address = f"127.0.0.1:{srv.port}" if transport == "tcp" else srv.inproc

    async def go():
        a, b = [await WorkerChannel.connect("w0", address, SECRET, name, lambda *_: None)
                for name in ("a", "b")]
        await a.call("add", _task("mine"))
        await b.call("add", _task("other"))
        a.close()
        await _until(lambda: ("abort", "mine") in w.calls, "a's leg aborted")
        assert ("abort", "other") not in w.calls and srv.legs == 1
        b.close()
        await _until(lambda: ("abort", "other") in w.calls, "b's leg aborted")

    asyncio.run(go())
    srv.close()
    assert srv.legs == 0
