"""The front door's side of a worker's control channel (runtime/channel.py).

`WorkerChannel.connect` opens the TCP link (HMAC handshake with the cluster secret, in a
thread), then hands the socket to the event loop as an asyncio Protocol (a worker in this
process, at ``inproc://NAME``: an in-process link carrying the same frames): each step
message of the worker is decoded once (`on_batch(load, entries)`, on the
loop, no task or Future per message), and commands are a frame write plus one Future
for the reply. `ChannelActor` puts the hot commands (CHANNEL_COMMANDS) on the channel
and forwards every other WorkerActor call (ready, stats, traces, shutdown) to the Ray
actor, so the router keeps calling `w.actor.<method>.remote(...)`.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import socket
from collections.abc import Callable
from typing import Any

from kv_transfer.tcp_auth import DeadlineSocket, client_handshake, handshake_reader
from runtime.batch_codec import decode_batch
from runtime.channel import (
    HEADER,
    INPROC,
    KIND_CALL,
    KIND_EVENTS,
    KIND_REPLY,
    MAX_FRAME_BYTES,
    connect_inproc,
    frame,
)

CHANNEL_COMMANDS = ("add", "reserve", "abort", "keepalive", "set_decode_pressure")
CONNECT_TIMEOUT_S = 10.0
OnBatch = Callable[[Any, list], None]  # (load, entries) of one step message


def _open(address: str, secret: bytes, name: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
    try:
        dl = DeadlineSocket(sock, CONNECT_TIMEOUT_S)
        client_handshake(dl, handshake_reader(dl), secret, name)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


def _retrieve(fut: asyncio.Future) -> None:
    """A fire-and-forget command's failure is not an unhandled error."""
    if not fut.cancelled():
        fut.exception()


class _InprocTransport:
    """What WorkerChannel uses of its transport, over an in-process link."""

    def __init__(self, link):
        self._link = link

    def write(self, data: bytes) -> None:
        self._link.receive(data)

    def abort(self) -> None:
        self._link.close()


class WorkerChannel(asyncio.Protocol):
    def __init__(self, worker_id: str, on_batch: OnBatch):
        self.worker_id = worker_id
        self._on_batch = on_batch
        self._buf = bytearray()
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._transport: asyncio.Transport | None = None
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    @classmethod
    async def connect(cls, worker_id: str, address: str, secret: bytes, name: str,
                      on_batch: OnBatch) -> WorkerChannel:
        loop = asyncio.get_running_loop()
        if address.startswith(INPROC):
            proto = cls(worker_id, on_batch)
            link = connect_inproc(address, name,
                                  lambda data: loop.call_soon_threadsafe(proto.data_received, data),
                                  lambda: loop.call_soon_threadsafe(proto.connection_lost, None))
            proto.connection_made(_InprocTransport(link))
        else:
            sock = await loop.run_in_executor(None, _open, address, secret, name)
            _, proto = await loop.create_connection(lambda: cls(worker_id, on_batch), sock=sock)
        await proto.call("hello")  # the first frame subscribes the link to load updates
        return proto

    # ---- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        size = HEADER.size
        try:
            while end - pos >= size:
                n, kind = HEADER.unpack_from(buf, pos)
                if not 1 <= n <= MAX_FRAME_BYTES:
                    raise ConnectionError(f"channel frame of {n} bytes from {self.worker_id}")
                if end - pos < 4 + n:
                    break
                body = bytes(buf[pos + size:pos + 4 + n])
                pos += 4 + n
                if kind == KIND_EVENTS:
                    _, load, entries = decode_batch(body)
                    self._on_batch(load, entries)
                elif kind == KIND_REPLY:
                    self._resolve(*pickle.loads(body))
                else:
                    raise ConnectionError(f"unexpected channel frame kind {kind}")
        except Exception as e:
            self._fail(e)
            return
        finally:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError(f"channel to {self.worker_id} closed"))

    # ---- calls --------------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> asyncio.Future:
        """Send a command now; the Future holds its result or raises its exception."""
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieve)
        if self.lost.done() or self._transport is None:
            fut.set_exception(ConnectionError(f"channel to {self.worker_id} is closed"))
            return fut
        call_id = next(self._ids)
        self._calls[call_id] = fut
        self._transport.write(frame(KIND_CALL, pickle.dumps((call_id, name, args))))
        return fut

    def _resolve(self, call_id: int, ok: bool, value: Any) -> None:
        fut = self._calls.pop(call_id, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value if isinstance(value, BaseException) else RuntimeError(value))

    def _fail(self, exc: BaseException) -> None:
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"channel to {self.worker_id} lost: {exc}"))
        if not self.lost.done():
            self.lost.set_result(exc)
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        self._fail(ConnectionError("closed by the router"))


class _Command:
    __slots__ = ("_holder", "_name")

    def __init__(self, holder: Any, name: str):
        self._holder, self._name = holder, name

    def remote(self, *args: Any) -> asyncio.Future:
        link: WorkerChannel | None = self._holder.link
        if link is None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(ConnectionError(f"no channel to {self._name}'s worker"))
            fut.add_done_callback(_retrieve)
            return fut
        return link.call(self._name, *args)


class ChannelActor:
    """A WorkerActor whose hot commands travel over `holder.link` (the worker's current
    channel, replaced when it reconnects); the rest goes to the Ray actor."""

    def __init__(self, ray_actor: Any, holder: Any):
        self.ray_actor = ray_actor
        for name in CHANNEL_COMMANDS:
            setattr(self, name, _Command(holder, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ray_actor, name)
