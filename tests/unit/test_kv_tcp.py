"""TCP connector: round trips, HMAC handshake, corrupt frames, dead and hung peers."""

from __future__ import annotations

import os
import random
import socket
import time

import pytest
import torch

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.tcp_auth import client_handshake, handshake_reader
from kv_transfer.tcp_connector import parse_acks, parse_tcp_endpoint
from kv_transfer.testing import PagedKV, make_chunks, pump, random_bounds
from kv_transfer.wire import FrameReader, encode, encode_control
from tests.kv_peer import check_hung_then_killed, wait_failed

SECRET = b"cluster-secret-for-tests-0123456789"


def _cfg(**kw) -> TransferConfig:
    kw.setdefault("failure_timeout_s", 1.0)
    return TransferConfig(connector="tcp", secret=kw.pop("secret", SECRET), **kw)


def _chunk(rid: str, seq: int, final: bool, tokens: int = 16) -> KVChunk:
    p = torch.randn(2, 2, tokens, 2, 16)
    return KVChunk(rid, seq, seq * tokens, (seq + 1) * tokens, p, is_final=final,
                   first_token=1 if final else None)


@pytest.mark.parametrize(("src_block", "dst_block"), [(16, 32), (128, 16)])
def test_round_trip_random_ranges_across_block_sizes_is_byte_exact(src_block, dst_block):
    cfg = _cfg(max_frame_bytes=64 << 10, credit_window_bytes=512 << 10, coalesce_bytes=256 << 10)
    shape = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32}
    src = PagedKV(**shape, block_size=src_block, num_blocks=4096 // src_block)
    dst = PagedKV(**shape, block_size=dst_block, num_blocks=4096 // dst_block)
    rng = random.Random(src_block)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        lens = {f"r{i}": rng.randint(2, 400) for i in range(4)}
        for i, (rid, n) in enumerate(lens.items()):
            src.allocate(rid, n)
            src.fill_random(rid, n, seed=i)
            dst.allocate(rid, n)
            for c in make_chunks(src, rid, random_bounds(rng, n)):
                tx.send(c, dest=rx.endpoint)
        assert pump(tx, rx, dst, lens) == ({}, {})
        for rid, n in lens.items():
            assert torch.equal(dst.export(rid, 0, n), src.export(rid, 0, n)), rid
        assert rx.stats()["auth_failures"] == 0 and tx.stats()["links"][rx.endpoint]["connects"] == 1
    finally:
        tx.close()
        rx.close()


def test_sender_with_the_wrong_secret_is_refused_and_gets_no_frame_in():
    rx = make_receiver(_cfg())
    tx = make_sender(_cfg(secret=b"not-the-cluster-secret!!"))
    try:
        tx.send(_chunk("r", 0, True), dest=rx.endpoint)
        why, _ = wait_failed(tx, "r", 10)
        assert "failed authentication" in why
        time.sleep(0.1)
        assert rx.poll().chunks == [] and rx.stats()["frames_received"] == 0
        assert rx.stats()["auth_failures"] == 1
    finally:
        tx.close()
        rx.close()


def _connect(endpoint: str) -> socket.socket:
    s = socket.create_connection(parse_tcp_endpoint(endpoint), timeout=5)
    s.settimeout(5)
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("attack", ["no_handshake", "bad_proof"])
def test_peer_failing_the_handshake_is_disconnected_and_no_frame_accepted(attack):
    rx = make_receiver(_cfg())
    s = _connect(rx.endpoint)
    try:
        frame = b"".join(bytes(b) for b in encode(_chunk("evil", 0, True)))
        if attack == "bad_proof":
            s.sendall(encode_control({"k": "hello", "nc": os.urandom(32), "id": "mallory"}))
            assert handshake_reader(s).read().kind == "challenge"
            s.sendall(encode_control({"k": "auth", "pc": os.urandom(32)}))
        try:
            s.sendall(frame)
        except OSError:
            pass  # already disconnected
        assert _closed_by_peer(s)
        time.sleep(0.1)
        assert rx.poll().chunks == [] and rx.stats()["frames_received"] == 0
        assert rx.stats()["auth_failures"] == 1
    finally:
        s.close()
        rx.close()


def _authenticated(endpoint: str) -> tuple[socket.socket, FrameReader]:
    s = _connect(endpoint)
    reader = handshake_reader(s)
    client_handshake(s, reader, SECRET, "raw-test-client")
    reader.max_frame_bytes = reader.max_header_bytes = 1 << 16
    return s, reader


def test_checksum_mismatch_over_tcp_fails_the_request_on_both_ends():
    rx = make_receiver(_cfg())
    s, reader = _authenticated(rx.endpoint)
    try:
        head, payload = encode(_chunk("r", 0, True))
        corrupt = bytearray(payload)
        corrupt[5] ^= 0xFF
        s.sendall(bytes(head) + bytes(corrupt))
        msg = reader.read()
        while msg.kind == "hb":
            msg = reader.read()
        [ack] = parse_acks(msg.control)
        assert ack.status == 2 and "checksum mismatch" in ack.reason  # FAILED
        ev = rx.poll()
        assert ev.chunks == [] and ev.failed[0][0] == "r" and "checksum" in ev.failed[0][1]
        # the stream is still in sync: the next request on the same connection works
        s.sendall(b"".join(bytes(b) for b in encode(_chunk("ok", 0, True))))
        deadline = time.monotonic() + 5
        while not (chunks := rx.poll().chunks) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [c.request_id for c in chunks] == ["ok"]
    finally:
        s.close()
        rx.close()


def test_receiver_fails_requests_of_a_silent_sender_within_the_timeout():
    rx = make_receiver(_cfg(failure_timeout_s=0.5))
    s, _ = _authenticated(rx.endpoint)
    try:
        s.sendall(b"".join(bytes(b) for b in encode(_chunk("r", 0, False))))
        t0 = time.monotonic()
        failed = []
        while not failed and time.monotonic() - t0 < 10:
            failed = rx.poll().failed
            time.sleep(0.01)
        assert failed and "sender silent" in failed[0][1]
        assert time.monotonic() - t0 < 0.5 * 2 + 1.0
    finally:
        s.close()
        rx.close()


def test_receiver_closed_mid_stream_fails_the_request_within_the_timeout():
    cfg = _cfg(send_policy="paced", rate_bytes_per_s=2e6, burst_bytes=64 << 10)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        for i in range(100):
            tx.send(_chunk("r", i, i == 99), dest=rx.endpoint)
        while rx.stats()["frames_received"] < 3:
            for c in rx.poll().chunks:
                rx.release(c)
            time.sleep(0.01)
        rx.close()
        why, dt = wait_failed(tx, "r", 10)
        assert dt <= cfg.failure_timeout_s + 0.5, why
        # the request may fail first on the receiver's "discarded" acks of in-flight frames;
        # the EOF that fails the link follows within the timeout
        end = time.monotonic() + cfg.failure_timeout_s + 0.5
        while tx.stats()["link_failures"] == 0 and time.monotonic() < end:
            time.sleep(0.01)
        assert tx.stats()["queued_bytes"] == 0 and tx.stats()["link_failures"] == 1, why
    finally:
        tx.close()
        rx.close()


def test_receiver_process_hung_then_killed_mid_stream_is_detected_within_the_timeout():
    check_hung_then_killed(_cfg(send_policy="paced", rate_bytes_per_s=40e6,
                                burst_bytes=1 << 20), _chunk)
