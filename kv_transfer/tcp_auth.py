"""Mutual HMAC challenge/response run on every TCP link before any KV frame.

    sender   -> receiver  hello     {nc: 32 random bytes, id: sender id}
    receiver -> sender    challenge {ns: 32 random bytes, ps: HMAC(secret, "pdkv-s" nc ns)}
    sender   -> receiver  auth      {pc: HMAC(secret, "pdkv-c" ns nc)}
    receiver -> sender    welcome   {}

Both sides contribute a fresh nonce, so a recorded exchange cannot be replayed, and the
two proofs use different labels, so one side's proof is never a valid answer for the
other (no reflection). Proofs are compared with ``hmac.compare_digest``. Before the
handshake the reader only accepts tiny control frames into a tiny buffer, so an
unauthenticated peer cannot make the receiver allocate payload buffers, and the receiver
gives the whole handshake one deadline (``DeadlineSocket``): a peer dripping a byte at a
time cannot hold a connection open. The secret is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from typing import Any

from kv_transfer.wire import FrameReader, WireError, encode_control

NONCE_BYTES = 32
HANDSHAKE_FRAME_LIMIT = 1024  # bytes of a whole handshake frame (no payload allowed)


class DeadlineSocket:
    """The two socket calls a handshake makes, each bounded by what is left of one
    overall deadline (a per-call timeout would restart with every byte received)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock = sock
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"handshake not finished within {self._timeout_s:g}s")
        self._sock.settimeout(left)

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        self._arm()
        return self._sock.recv_into(buf, nbytes)

    def sendall(self, data: bytes) -> None:
        self._arm()
        self._sock.sendall(data)


class AuthError(Exception):
    """The peer failed (or broke off) the handshake."""


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def _expect(reader: FrameReader, kind: str) -> dict[str, Any]:
    try:
        msg = reader.read()
    except WireError as e:
        raise AuthError(f"malformed handshake: {e}") from None
    if msg is None:
        raise AuthError(f"peer closed the connection while we waited for {kind!r}")
    if msg.kind != kind or msg.control is None:
        raise AuthError(f"expected handshake message {kind!r}, got {msg.kind!r}")
    return msg.control


def _nonce(msg: dict[str, Any], key: str) -> bytes:
    v = msg.get(key)
    if not isinstance(v, bytes) or len(v) != NONCE_BYTES:
        raise AuthError(f"handshake field {key!r} must be {NONCE_BYTES} bytes")
    return v


def handshake_reader(sock: socket.socket | DeadlineSocket) -> FrameReader:
    """A reader limited to handshake-sized frames, with a buffer of that size; raise its
    limits (and ``rebind`` it to a bigger buffer) once authenticated."""
    return FrameReader(sock.recv_into, max_frame_bytes=HANDSHAKE_FRAME_LIMIT,
                       max_header_bytes=HANDSHAKE_FRAME_LIMIT, buffer_bytes=HANDSHAKE_FRAME_LIMIT)


def client_handshake(sock: socket.socket | DeadlineSocket, reader: FrameReader, secret: bytes,
                     sender_id: str) -> None:
    """Sender side: prove we know ``secret`` and check that the receiver does too."""
    nc = os.urandom(NONCE_BYTES)
    sock.sendall(encode_control({"k": "hello", "nc": nc, "id": sender_id[:128]}))
    ch = _expect(reader, "challenge")
    ns = _nonce(ch, "ns")
    ps = ch.get("ps")
    if not isinstance(ps, bytes) or not hmac.compare_digest(ps, _mac(secret, b"pdkv-s", nc, ns)):
        raise AuthError("receiver failed authentication (wrong cluster secret?)")
    sock.sendall(encode_control({"k": "auth", "pc": _mac(secret, b"pdkv-c", ns, nc)}))
    _expect(reader, "welcome")


def server_handshake(sock: socket.socket | DeadlineSocket, reader: FrameReader, secret: bytes) -> str:
    """Receiver side: returns the sender's id once it proved it knows ``secret``."""
    hello = _expect(reader, "hello")
    nc = _nonce(hello, "nc")
    peer = hello.get("id")
    if not isinstance(peer, str):
        raise AuthError("handshake field 'id' must be a str")
    ns = os.urandom(NONCE_BYTES)
    sock.sendall(encode_control({"k": "challenge", "ns": ns, "ps": _mac(secret, b"pdkv-s", nc, ns)}))
    auth = _expect(reader, "auth")
    pc = auth.get("pc")
    if not isinstance(pc, bytes) or not hmac.compare_digest(pc, _mac(secret, b"pdkv-c", ns, nc)):
        raise AuthError(f"sender {peer!r} failed authentication")
    sock.sendall(encode_control({"k": "welcome"}))
    return peer
