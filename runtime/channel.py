"""ChannelServer: a worker's control channel to the front doors (Ray-free).

Each front door (router) opens one TCP connection per worker, authenticated with the
cluster secret (runtime/channel_listener.py), and uses it both ways:

    router -> worker   C  (call id, command, args)   pickled; run on the WorkerLoop in
                                                      arrival order (one FIFO per link)
    worker -> router   R  (call id, ok, value)       pickled reply, when the command ran
    worker -> router   E  one step's events           msgpack (runtime/batch_codec.py)

So a decode step costs one message per front door carrying every request's new tokens,
and a command costs a write and a wake-up instead of a Ray actor call. A reply, or a
step message of at most DIRECT_MAX_EVENTS events, is written by the thread that makes it
(the loop thread) when the socket takes it whole without blocking and nothing is queued
before it: an idle step's first token costs no thread hop. Else it queues for the link's
writer thread: a slow front door never blocks the loop, and a big step's message is
encoded beside the next step (~0.5 us an event) instead of before it. Events go to the
link whose command created the leg (`add` / `reserve`); each message also carries the
worker's load, and links without events get it at most every LOAD_PERIOD_S while the
worker steps, and at once when it does not (idle, or its legs wait for KV: a reserve
there changes the load with no step to carry it), so every front door places requests
on fresh per-worker load.
"""

from __future__ import annotations

import logging
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from runtime.batch_codec import encode_batch
from runtime.channel_listener import Listener
from runtime.messages import EventKind, WorkerEvent, WorkerLoad

log = logging.getLogger(__name__)
HEADER = struct.Struct("!IB")  # body length (kind byte included), kind
KIND_CALL, KIND_REPLY, KIND_EVENTS = ord("C"), ord("R"), ord("E")
MAX_FRAME_BYTES = 64 << 20
LOAD_PERIOD_S = 0.02
DIRECT_MAX_EVENTS = 32
# kinds after which a role holds the leg no more (besides a finishing event)
LEG_ENDS = {
    "decode": frozenset({EventKind.PREEMPTED, EventKind.FAILED}),
    "prefill": frozenset({EventKind.PREFILL_DONE, EventKind.FAILED}),
    "colocated": frozenset({EventKind.FAILED}),
}
Command = Callable[..., Any]  # returns a Future (run on the loop) or a plain value


def frame(kind: int, body: bytes) -> bytes:
    return HEADER.pack(len(body) + 1, kind) + body


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """One frame from a blocking socket; None at EOF."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    n, kind = HEADER.unpack(head)
    if not 1 <= n <= MAX_FRAME_BYTES:
        raise ConnectionError(f"channel frame of {n} bytes")
    body = _recv_exact(sock, n - 1)
    if body is None:
        raise ConnectionError("channel closed mid-frame")
    return kind, body


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            if buf:
                raise ConnectionError("channel closed mid-frame")
            return None
        buf += part
    return bytes(buf)


class _Link:
    """One front door's connection: a reader thread (commands) and a writer thread."""

    def __init__(self, server: ChannelServer, sock: socket.socket, peer: str):
        self.server, self.sock, self.peer = server, sock, peer
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self._wlock = threading.Lock()
        self._queued = 0  # messages handed to the writer and not yet written (under _wlock)
        self.alive = True
        self.subscribed = False  # it spoke first: from now on it gets load messages
        self.last_load: WorkerLoad | None = None
        self.last_sent = 0.0

    def start(self) -> None:
        for target, name in ((self._read, "reader"), (self._write, "writer")):
            threading.Thread(target=target, name=f"channel-{name}:{self.peer}",
                             daemon=True).start()

    def send_events(self, events: list[WorkerEvent], load: WorkerLoad | None) -> None:
        self.last_load, self.last_sent = load, time.monotonic()
        self.send((events, load), direct=len(events) <= DIRECT_MAX_EVENTS)

    def send(self, item: bytes | tuple, direct: bool = True) -> None:
        """Write a frame (or a step's (events, load)) now if `direct`, the socket takes
        it without blocking and nothing waits before it; else the writer sends it."""
        with self._wlock:
            if direct and self._queued == 0 and self.alive:
                data = self._encode(item)
                try:
                    sent = self.sock.send(data, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as e:
                    log.info("channel link %s broke on send: %s", self.peer, e)
                    sent = len(data)  # the reader sees the link end and closes it
                if sent == len(data):
                    return
                item = memoryview(data)[sent:]
            self._queued += 1
            self.out.put(item)

    def _encode(self, item: bytes | memoryview | tuple) -> bytes | memoryview:
        if isinstance(item, tuple):
            events, load = item
            return frame(KIND_EVENTS, encode_batch(self.server.worker_id, events, load))
        return item

    def _reply(self, call_id: int, fut_or_value: Any) -> None:
        if not isinstance(fut_or_value, Future):
            self.send(frame(KIND_REPLY, _dump_reply(call_id, True, fut_or_value)))
            return

        def done(f: Future) -> None:
            exc = f.exception()
            body = _dump_reply(call_id, exc is None, exc if exc is not None else f.result())
            self.send(frame(KIND_REPLY, body))

        fut_or_value.add_done_callback(done)

    def _read(self) -> None:
        try:
            while self.alive:
                got = read_frame(self.sock)
                if got is None:
                    break
                kind, body = got
                if kind != KIND_CALL:
                    raise ConnectionError(f"unexpected channel frame kind {kind}")
                call_id, name, args = pickle.loads(body)
                self.subscribed = True
                try:
                    result = self.server.run_command(self, name, args)
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    self.send(frame(KIND_REPLY, _dump_reply(call_id, False, e)))
                    continue
                self._reply(call_id, result)
        except (OSError, ConnectionError, pickle.UnpicklingError, ValueError) as e:
            if self.alive:
                log.info("channel link %s broke: %s", self.peer, e)
        finally:
            self.close()

    def _write(self) -> None:
        try:
            while True:
                item = self.out.get()
                if item is None:
                    return
                self.sock.sendall(self._encode(item))
                with self._wlock:
                    self._queued -= 1
        except OSError as e:
            if self.alive:
                log.info("channel link %s broke on send: %s", self.peer, e)
        finally:
            self.close()

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.out.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.server.forget(self)


def _dump_reply(call_id: int, ok: bool, value: Any) -> bytes:
    try:
        return pickle.dumps((call_id, ok, value))
    except Exception:  # an exception (or value) that does not pickle: say what it was
        return pickle.dumps((call_id, False, RuntimeError(repr(value))))


class ChannelServer:
    """The worker side: listens on `host`, authenticates each front door with `secret`,
    runs its commands (`commands[name](*args)`) and sends it its legs' events."""

    def __init__(self, worker_id: str, role: str, secret: bytes,
                 commands: Mapping[str, Command], *, host: str = "127.0.0.1",
                 load: Callable[[], WorkerLoad] | None = None,
                 idle: Callable[[], bool] | None = None,
                 unrouted: Callable[[list[WorkerEvent]], None] | None = None):
        self.worker_id, self.role = worker_id, role
        self.commands = dict(commands)
        self._load, self._idle, self._unrouted = load, idle, unrouted
        self._ends = LEG_ENDS[role]
        self._links: list[_Link] = []
        self._origin: dict[str, _Link] = {}  # leg id -> the link that created the leg
        self._lock = threading.Lock()
        self.ever_linked = False
        self._listener = Listener(worker_id, secret, host, self._linked)
        self.host, self.port = self._listener.host, self._listener.port

    def set_role(self, role: str, commands: Mapping[str, Command]) -> None:
        """The worker changed role (cluster/launch/role_worker.py): its commands and the
        events that end a leg here are the new role's. Called between steps, with no leg
        held here."""
        self.role, self._ends, self.commands = role, LEG_ENDS[role], dict(commands)

    @property
    def legs(self) -> int:
        """Legs whose events are routed to a link (0 once every leg ended: a leak check)."""
        return len(self._origin)

    def _linked(self, sock: socket.socket, peer: str) -> None:
        link = _Link(self, sock, peer)
        with self._lock:
            self.ever_linked = True
            self._links.append(link)
        link.start()  # registered first: the step messages and close() reach it at once

    def forget(self, link: _Link) -> None:
        with self._lock:
            if link in self._links:
                self._links.remove(link)
            for leg_id in [k for k, v in self._origin.items() if v is link]:
                del self._origin[leg_id]

    def run_command(self, link: _Link, name: str, args: tuple) -> Any:
        fn = self.commands.get(name)
        if fn is None:
            raise ValueError(f"unknown channel command {name!r}")
        if name == "abort":
            self._origin.pop(args[0], None)
        if name not in ("add", "reserve"):
            return fn(*args)
        leg_id = args[0].leg_id
        self._origin[leg_id] = link  # before it runs: its first events may follow at once
        try:
            result = fn(*args)
        except Exception:
            self._drop(leg_id, link)
            raise
        if isinstance(result, Future):
            result.add_done_callback(lambda f: self._settled(leg_id, link, f))
        elif result is False:
            self._drop(leg_id, link)
        return result

    def _settled(self, leg_id: str, link: _Link, fut: Future) -> None:
        """A refused `reserve` (False) or a failed command created no leg here."""
        if fut.exception() is not None or fut.result() is False:
            self._drop(leg_id, link)

    def _drop(self, leg_id: str, link: _Link) -> None:
        if self._origin.get(leg_id) is link:
            del self._origin[leg_id]

    def publish(self, events: list[WorkerEvent]) -> None:
        """One step's events (called on the loop thread, possibly with none)."""
        by_link: dict[int, list[WorkerEvent]] = {}
        unrouted = []
        origin, ends = self._origin, self._ends
        for ev in events:
            link = origin.get(ev.leg_id)
            if link is None:
                unrouted.append(ev)
                continue
            by_link.setdefault(id(link), []).append(ev)
            if ev.finish_reason is not None or ev.kind in ends:
                origin.pop(ev.leg_id, None)
        if unrouted and self._unrouted is not None and not self.ever_linked:
            self._unrouted(unrouted)  # a router without a channel polls for them
        if not self._links:
            return
        load = self._load() if self._load is not None else None
        idle = self._idle() if self._idle is not None else False
        now = time.monotonic()
        for link in list(self._links):
            mine = by_link.get(id(link))
            if mine or (link.subscribed and load != link.last_load
                        and (idle or now - link.last_sent >= LOAD_PERIOD_S)):
                link.send_events(mine or [], load)

    def close(self) -> None:
        self._listener.close()
        for link in list(self._links):
            link.close()
