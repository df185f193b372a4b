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

A worker without a cluster secret (a front door in its own process: tests' scripted
workers) serves the same frames over in-process links instead (`connect_inproc`, address
``inproc://NAME``), as kv_transfer/inproc.py is the KV links' in-process transport.

A link that ends takes its legs with it: they are aborted (`forget`), since their front
door is gone or, having lost the link, re-dispatched them; a leg's events with no link
are dropped.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import queue
import socket
import struct
import threading
import time
import weakref
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
INPROC = "inproc://"
_hub: weakref.WeakValueDictionary[str, ChannelServer] = weakref.WeakValueDictionary()
_hub_lock = threading.Lock()
_ids = itertools.count()
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

    def _command(self, kind: int, body: bytes) -> None:
        if kind != KIND_CALL:
            raise ConnectionError(f"unexpected channel frame kind {kind}")
        call_id, name, args = pickle.loads(body)
        self.subscribed = True
        try:
            result = self.server.run_command(self, name, args)
        except Exception as e:  # noqa: BLE001 - the caller gets it
            self.send(frame(KIND_REPLY, _dump_reply(call_id, False, e)))
            return
        self._reply(call_id, result)

    def _read(self) -> None:
        try:
            while self.alive:
                got = read_frame(self.sock)
                if got is None:
                    break
                self._command(*got)
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


class _InprocLink(_Link):
    """A front door in this process: the same frames, handed over by call. `deliver`
    (thread-safe) takes the worker's frames to the front door, `lost` says the link
    ended; `receive` runs the front door's frames on its own thread."""

    def __init__(self, server: ChannelServer, peer: str, deliver: Callable[[bytes], None],
                 lost: Callable[[], None]):
        super().__init__(server, None, peer)  # type: ignore[arg-type] - no socket
        self._deliver, self._lost = deliver, lost

    def start(self) -> None:
        pass

    def send(self, item: bytes | tuple, direct: bool = True) -> None:
        if not self.alive:
            return
        try:
            self._deliver(bytes(self._encode(item)))
        except RuntimeError:  # the front door's event loop is closed
            self.close()

    def receive(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            n, kind = HEADER.unpack_from(data, pos)
            self._command(kind, data[pos + HEADER.size:pos + 4 + n])
            pos += 4 + n

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.server.forget(self)
        try:
            self._lost()
        except RuntimeError:  # (its event loop is closed: nobody to tell)
            pass


def connect_inproc(address: str, peer: str, deliver: Callable[[bytes], None],
                   lost: Callable[[], None]) -> _InprocLink:
    """A link to the in-process ChannelServer at `address` (``inproc://NAME``)."""
    with _hub_lock:
        server = _hub.get(address.removeprefix(INPROC)) if address.startswith(INPROC) else None
    if server is None:
        raise ConnectionRefusedError(f"no in-process channel at {address!r}")
    link = _InprocLink(server, peer, deliver, lost)
    server.add_link(link)
    return link


def _dump_reply(call_id: int, ok: bool, value: Any) -> bytes:
    try:
        return pickle.dumps((call_id, ok, value))
    except Exception:  # an exception (or value) that does not pickle: say what it was
        return pickle.dumps((call_id, False, RuntimeError(repr(value))))


class ChannelServer:
    """The worker side: listens on `host`, authenticates each front door with `secret`,
    runs its commands (`commands[name](*args)`) and sends it its legs' events. Without a
    secret it serves in-process links only, at `inproc` (``inproc://NAME``)."""

    def __init__(self, worker_id: str, role: str, secret: bytes,
                 commands: Mapping[str, Command], *, host: str = "127.0.0.1",
                 load: Callable[[], WorkerLoad] | None = None,
                 idle: Callable[[], bool] | None = None):
        self.worker_id, self.role = worker_id, role
        self.commands = dict(commands)
        self._load = load
        self.idle = idle  # did the worker's last step run no model? (None: it steps)
        self._ends = LEG_ENDS[role]
        self._links: list[_Link] = []
        self._origin: dict[str, _Link] = {}  # leg id -> the link that created the leg
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self.inproc = ""
        self.host, self.port = "", 0
        if secret:
            self._listener = Listener(worker_id, secret, host, self._linked)
            self.host, self.port = self._listener.host, self._listener.port
        else:
            name = f"{worker_id}-{next(_ids)}"
            self.inproc = INPROC + name
            with _hub_lock:
                _hub[name] = self

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
        self.add_link(_Link(self, sock, peer))

    def add_link(self, link: _Link) -> None:
        with self._lock:
            self._links.append(link)
        link.start()  # registered first: the step messages and close() reach it at once

    def forget(self, link: _Link) -> None:
        """`link` ended: the legs it created are aborted (their front door is gone, or
        re-dispatched them when it lost the link: nobody reads or ends them any more)."""
        with self._lock:
            if link in self._links:
                self._links.remove(link)
            orphans = [k for k, v in self._origin.items() if v is link]
            for leg_id in orphans:
                del self._origin[leg_id]
        abort = self.commands.get("abort")
        for leg_id in orphans if abort is not None else ():
            try:
                abort(leg_id)
            except Exception as e:  # noqa: BLE001 - a stopped worker holds nothing any more
                log.info("%s: abort of %s after its link ended failed: %s", self.worker_id,
                         leg_id, e)

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
        origin, ends = self._origin, self._ends
        for ev in events:
            link = origin.get(ev.leg_id)
            if link is None:  # its front door's link ended (that router re-dispatched it)
                continue
            by_link.setdefault(id(link), []).append(ev)
            if ev.finish_reason is not None or ev.kind in ends:
                origin.pop(ev.leg_id, None)
        if not self._links:
            return
        load = self._load() if self._load is not None else None
        idle = self.idle() if self.idle is not None else False
        now = time.monotonic()
        for link in list(self._links):
            mine = by_link.get(id(link))
            if mine or (link.subscribed and load != link.last_load
                        and (idle or now - link.last_sent >= LOAD_PERIOD_S)):
                link.send_events(mine or [], load)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        with _hub_lock:
            if _hub.get(self.inproc.removeprefix(INPROC)) is self:
                del _hub[self.inproc.removeprefix(INPROC)]
        for link in list(self._links):
            link.close()
