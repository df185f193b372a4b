"""TCP connector: one persistent, HMAC-authenticated connection per (sender, receiver).

Sender -> receiver: KV frames, written with scatter/gather ``sendmsg`` (header bytes +
a zero-copy view of each payload; a coalesced batch goes out in one call), plus
heartbeats while requests are active. Receiver -> sender on the same socket: ack
batches (credit) and heartbeats every ``failure_timeout_s / 3``.

Faults: a send blocked, or no ack/heartbeat heard, for ``failure_timeout_s`` (socket
timeout), EOF or reset fails the link: every request with frames on it is reported
failed, its queued frames dropped; the next ``send`` to that dest reconnects. The
receiver fails a link's incomplete requests when the sender goes silent that long.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.receiver import InboxReceiver
from kv_transfer.sender import ThreadedSender
from kv_transfer.tcp_auth import client_handshake, handshake_reader
from kv_transfer.tcp_receiver import TcpReceiver
from kv_transfer.transport import LinkEvents, LinkTransport
from kv_transfer.wire import (
    MAX_HEADER_BYTES,
    PREAMBLE,
    Ack,
    Piece,
    WireError,
    encode,
    encode_control,
    payload_view,
)

_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)
_CONTROL_LIMIT = PREAMBLE.size + MAX_HEADER_BYTES

__all__ = ["TcpReceiver", "TcpTransport", "make_tcp_receiver", "make_tcp_sender",
           "parse_tcp_endpoint", "sendmsg_all"]


def parse_tcp_endpoint(dest: str) -> tuple[str, int]:
    """``tcp://host:port`` (IPv6 hosts in brackets) -> (host, port)."""
    if not dest.startswith("tcp://"):
        raise ValueError(f"tcp dest must look like tcp://HOST:PORT, got {dest!r}")
    host, sep, port = dest[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"tcp dest must look like tcp://HOST:PORT, got {dest!r}")
    return host.strip("[]"), int(port)


def sendmsg_all(sock: socket.socket, buffers: list) -> None:
    """Write every buffer, in order, with as few ``sendmsg`` calls as the kernel allows."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX])
        while sent:  # advance over fully written buffers, trim a partly written one
            n = len(views[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def parse_acks(control: dict) -> list[Ack]:
    items = control.get("a")
    if not isinstance(items, list):
        raise WireError("ack message without an 'a' list")
    acks = []
    for it in items:
        if not (isinstance(it, list) and len(it) == 6 and isinstance(it[0], str)
                and all(type(x) is int for x in (*it[1:4], it[5])) and isinstance(it[4], str)):
            raise WireError(f"malformed ack entry {it!r}")
        acks.append(Ack(*it))
    return acks


class TcpTransport(LinkTransport):
    """Sender side of one link."""

    def __init__(self, dest: str, events: LinkEvents, cfg: TransferConfig, sender_id: str) -> None:
        self._host, self._port = parse_tcp_endpoint(dest)
        self._dest = dest
        self._events = events
        self._cfg = cfg
        self._sender_id = sender_id
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._closed = False

    def connect(self) -> None:
        cfg = self._cfg
        sock = socket.create_connection((self._host, self._port), timeout=cfg.failure_timeout_s)
        with self._lock:
            if self._closed:
                sock.close()
                raise ConnectionAbortedError("link closed while connecting")
            self._sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if cfg.socket_buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.socket_buffer_bytes)
        reader = handshake_reader(sock)
        client_handshake(sock, reader, cfg.secret, self._sender_id)
        reader.max_frame_bytes = reader.max_header_bytes = _CONTROL_LIMIT
        reader.rebind(sock.recv_into, buffer_bytes=_CONTROL_LIMIT)
        self._authenticated(sock, reader)
        self._reader = threading.Thread(target=self._read_acks, args=(reader,), daemon=True,
                                        name=f"kv-acks<-{self._dest}")
        self._reader.start()

    def _authenticated(self, sock: socket.socket, reader) -> None:  # noqa: B027 - a hook
        """After the handshake, before the ack reader starts: a subclass's own setup
        messages on the authenticated connection (the nixl connector's region grant)."""

    def _on_acks(self, acks: list[Ack]) -> None:
        self._events.on_acks(acks)

    # fault injection (tests; kv_transfer.faults): a replacement payload written after
    # the header, whose checksum was computed from the real one
    wire_tamper: Callable[[Piece], torch.Tensor | None] | None = None

    def transmit(self, pieces: list[Piece]) -> None:
        buffers: list = []
        for p in pieces:
            frame = encode(p, checksum_algo=self._cfg.checksum_algo)
            if self.wire_tamper is not None and len(frame) > 1:
                bad = self.wire_tamper(p)
                frame[1] = frame[1] if bad is None else payload_view(bad)
            buffers.extend(frame)
        assert self._sock is not None
        sendmsg_all(self._sock, buffers)

    def heartbeat(self) -> None:
        assert self._sock is not None
        self._sock.sendall(encode_control({"k": "hb"}))

    def _read_acks(self, reader) -> None:
        t = self._cfg.failure_timeout_s
        try:
            while True:
                msg = reader.read()
                if msg is None:
                    raise ConnectionResetError("receiver closed the connection")
                if msg.kind == "ack":
                    self._on_acks(parse_acks(msg.control))
                elif msg.kind != "hb":
                    raise WireError(f"unexpected message {msg.kind!r} from receiver")
        except TimeoutError:
            self._fail(f"no ack or heartbeat from {self._dest} within {t:g}s")
        except (OSError, WireError) as e:
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, reason: str) -> None:
        if not self._closed:
            self._events.on_failure(reason)

    def close(self) -> None:
        """Shut the socket down (wakes both threads); the fd is closed in ``release``."""
        with self._lock:
            self._closed = True
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # never connected or already reset by the peer

    def release(self) -> None:
        self.close()
        if self._reader is not None:
            self._reader.join(timeout=5.0)
        if self._sock is not None:
            self._sock.close()


def make_tcp_sender(cfg: TransferConfig, **kwargs) -> ThreadedSender:
    sender_id = kwargs.pop("sender_id", None) or f"kv-tx-{uuid.uuid4().hex[:12]}"
    return ThreadedSender(
        cfg, lambda dest, events: TcpTransport(dest, events, cfg, sender_id), **kwargs
    )


def make_tcp_receiver(cfg: TransferConfig, **kwargs) -> InboxReceiver:
    return TcpReceiver(cfg, **kwargs)

