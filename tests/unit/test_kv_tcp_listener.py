"""The KV TCP listener before authentication, with real sockets: a slow-loris peer is cut
at the handshake's total deadline, idle connections beyond the cap wait in the backlog
(no thread, no buffer each), and an honest sender still gets through a flood."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import tracemalloc

import torch

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.tcp_connector import parse_tcp_endpoint
from kv_transfer.wire import encode_control

SECRET = b"cluster-secret-for-listener-tests-0123"


def _cfg(**kw) -> TransferConfig:
    return TransferConfig(connector="tcp", secret=SECRET, **kw)


def _connect(endpoint: str) -> socket.socket:
    return socket.create_connection(parse_tcp_endpoint(endpoint), timeout=30)


def _peer_closed(s: socket.socket) -> bool:
    """Whether the receiver has closed the connection (EOF or reset is waiting)."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1, socket.MSG_DONTWAIT) == b""
    except (ConnectionResetError, BlockingIOError):
        return True


def test_a_peer_dripping_its_hello_is_cut_at_the_handshake_deadline():
    # one byte every 0.1 s resets no per-read timeout (failure_timeout_s is 30 s); the
    # whole hello takes ~7 s to drip, the handshake may take 0.5 s in total
    rx = make_receiver(_cfg(failure_timeout_s=30.0, handshake_timeout_s=0.5))
    s = _connect(rx.endpoint)
    hello = encode_control({"k": "hello", "nc": os.urandom(32), "id": "slow-loris"})
    sent = 0
    try:
        while sent < len(hello) and not _peer_closed(s):
            try:
                s.send(hello[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            time.sleep(0.1)
        assert sent < len(hello), "the receiver let a peer drip its whole hello"
        deadline = time.monotonic() + 30
        while rx.stats()["auth_failures"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert rx.stats()["pending_handshakes"] == 0 and rx.stats()["frames_received"] == 0
    finally:
        s.close()
        rx.close()


def _conn_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-rx-conn")]


def test_idle_connections_beyond_the_cap_wait_in_the_backlog_and_an_honest_sender_gets_in():
    cap, idle_n = 4, 16
    cfg = _cfg(failure_timeout_s=30.0, handshake_timeout_s=0.5, max_pending_connections=cap)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idle = [_connect(rx.endpoint) for _ in range(idle_n)]  # say nothing, ever
    try:
        # the honest sender connects behind all of them; the listener takes connections in
        # order, so when its request is through, every idle one was accepted before it
        tx.send(KVChunk("r", 0, 0, 4, torch.ones(1, 2, 4, 1, 8), is_final=True, first_token=1),
                dest=rx.endpoint)
        deadline = time.monotonic() + 60
        done = False
        while not done:
            assert time.monotonic() < deadline, rx.stats()
            for c in rx.poll().chunks:
                rx.release(c)
            ev = tx.poll()
            assert not ev.failed, ev.failed
            done = ev.finished == ["r"]
            assert len(_conn_threads()) <= cap  # no thread per idle connection
            time.sleep(0.01)
        grown = tracemalloc.get_traced_memory()[0] - before
        assert rx.stats()["pending_handshakes_peak"] == cap
        # no 256 KiB read buffer per pending connection (16 would be 4 MiB)
        assert grown < 2 << 20, grown
        open_idle = list(idle)
        while open_idle:  # the deadline ends every one of them
            assert time.monotonic() < deadline, f"{len(open_idle)} idle connections still open"
            open_idle = [s for s in open_idle if not _peer_closed(s)]
            time.sleep(0.01)
        assert rx.stats()["auth_failures"] == idle_n and rx.stats()["pending_handshakes"] == 0
    finally:
        tracemalloc.stop()
        for s in idle:
            s.close()
        tx.close()
        rx.close()


def test_a_rebound_reader_keeps_the_bytes_its_handshake_buffer_already_held():
    from kv_transfer.tcp_auth import handshake_reader

    a, b = socket.socketpair()
    try:
        # the peer pipelines its first frame right behind the handshake message
        a.sendall(encode_control({"k": "auth", "pc": b"x" * 32}) + encode_control({"k": "hb"}))
        reader = handshake_reader(b)
        assert reader.read().kind == "auth"
        reader.rebind(b.recv_into, buffer_bytes=256 << 10)
        assert reader.read().kind == "hb"
    finally:
        a.close()
        b.close()
