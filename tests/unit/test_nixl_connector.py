"""NIXL connector: real NIXL agents (UCX over host memory), in this process and in child
processes. The staging allocator as a state machine; an aborted request's extents kept
until its writes are acked; a write past its lease; the authenticated grant; corrupt
payloads; a decode process killed mid-transfer failing only its requests; a prefill
process hung then killed leaving no staging region behind. The connector contract
(round trips, lifecycle) runs in test_kv_inproc.py, its TP in test_kv_tp_transfer.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytest.importorskip("nixl_cu12")

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender  # noqa: E402
from kv_transfer.nixl_memory import ALIGN, Extents  # noqa: E402
from kv_transfer.testing import PagedKV, make_chunks, pump  # noqa: E402
from tests.kv_peer import REPO, check_hung_then_killed, wait_failed  # noqa: E402
from tests.unit.test_kv_tp_transfer import run_tp_transfer  # noqa: E402

SECRET = b"nixl-connector-tests-secret-0123456789"


def _cfg(**kw) -> TransferConfig:
    kw.setdefault("failure_timeout_s", 1.0)
    return TransferConfig(connector="nixl", secret=kw.pop("secret", SECRET), **kw)


def _chunk(rid: str, seq: int, final: bool, tokens: int = 16) -> KVChunk:
    p = torch.randn(2, 2, tokens, 2, 16)
    return KVChunk(rid, seq, seq * tokens, (seq + 1) * tokens, p, is_final=final,
                   first_token=1 if final else None)


def _wait(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(0.005)


def _transport(tx, dest: str):
    return tx._links[dest].transport


def _slots_disjoint(transport) -> None:
    """No two frames in flight on a link share a byte of the receiver's staging region."""
    with transport._slots_lock:
        spans = sorted((off, off + n) for off, n, _ in transport._slots.values() if n)
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start, spans


def _assert_no_leak(tx, rx) -> None:
    s, r = tx.stats(), rx.stats()
    assert s["inflight_bytes"] == 0 and s["queued_bytes"] == 0 and s["active_requests"] == 0, s
    assert r["inflight_bytes"] == 0 and r["active_requests"] == 0 and r["inbox_chunks"] == 0, r
    for link in tx._links.values():
        t = link.transport
        assert t._slots == {} and t._extents.used == 0, t._slots
        assert t._extents.free_ranges == [(0, t._extents.size)]


@pytest.mark.parametrize(("h", "p_tp", "d_tp"), [(2, 2, 1), (2, 1, 2)])
def test_nixl_kv_across_tp_degrees_is_byte_exact(h, p_tp, d_tp):
    run_tp_transfer("nixl", h, p_tp, d_tp)


def test_with_ucx_peer_error_handling_chunks_still_arrive_byte_exact():
    """``nixl_ucx_error_handling="peer"``: UCX keeps to transports that report a dead
    peer (loopback TCP for the notifications here); the bytes are the same."""
    cfg = _cfg(nixl_ucx_error_handling="peer", max_frame_bytes=64 << 10,
               credit_window_bytes=256 << 10)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    src = PagedKV(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64)
    dst = PagedKV(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, num_blocks=128)
    try:
        src.allocate("r", 300)
        src.fill_random("r", 300, seed=3)
        dst.allocate("r", 300)
        for c in make_chunks(src, "r", [0, 7, 150, 300]):
            tx.send(c, dest=rx.endpoint)
        assert pump(tx, rx, dst, ["r"]) == ({}, {})
        assert torch.equal(dst.export("r", 0, 300), src.export("r", 0, 300))
        _assert_no_leak(tx, rx)
    finally:
        tx.close()
        rx.close()


class ExtentsMachine(RuleBasedStateMachine):
    """Random takes and frees (in any order) against a model of the held ranges: held
    ranges never overlap, what is free plus what is held is the region, and freeing all
    leaves one range."""

    SIZE = 64 * ALIGN

    def __init__(self) -> None:
        super().__init__()
        self.ext = Extents(self.SIZE)
        self.held: list[tuple[int, int]] = []

    @rule(n=st.integers(1, 20 * ALIGN))
    def take(self, n):
        off = self.ext.try_take(n)
        need = -(-n // ALIGN) * ALIGN
        free = self.ext.free_ranges
        if off is None:
            assert all(ln < need for _, ln in free)
        else:
            assert off % ALIGN == 0 and off + need <= self.SIZE
            self.held.append((off, n))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def free(self, i):
        off, n = self.held.pop(i % len(self.held))
        self.ext.free(off, n)

    @invariant()
    def accounted(self):
        spans = sorted((o, o + -(-n // ALIGN) * ALIGN) for o, n in self.held)
        spans += [(o, o + n) for o, n in self.ext.free_ranges]
        spans.sort()
        pos = 0
        for a, b in spans:
            assert a == pos, spans  # no overlap, no hole
            pos = b
        assert pos == self.SIZE
        assert self.ext.used == sum(-(-n // ALIGN) * ALIGN for _, n in self.held)

    def teardown(self):
        for off, n in self.held:
            self.ext.free(off, n)
        assert self.ext.free_ranges == [(0, self.SIZE)] and self.ext.used == 0


TestExtents = ExtentsMachine.TestCase
TestExtents.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_an_aborted_requests_extents_are_not_reused_until_its_writes_are_acked():
    cfg = _cfg(max_frame_bytes=64 << 10, credit_window_bytes=256 << 10, failure_timeout_s=5.0)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        a = [_chunk("a", i, False, tokens=32) for i in range(3)]  # 16 KiB each
        for c in a:
            tx.send(c, dest=rx.endpoint)
        held: list[KVChunk] = []
        _wait(lambda: held.extend(rx.poll().chunks) or len(held) == 3, what="a's chunks")
        t = _transport(tx, rx.endpoint)
        a_spans = {tuple(s[:2]) for s in t._slots.values()}
        assert len(a_spans) == 3 and t._extents.used == 3 * (16 << 10)
        tx.abort("a")  # the owner still holds a's chunks: their bytes must stay untouched
        for i in range(6):
            tx.send(_chunk("b", i, i == 5, tokens=32), dest=rx.endpoint)
        got_b: list[KVChunk] = []

        def b_moves():
            _slots_disjoint(t)
            assert a_spans <= {tuple(s[:2]) for s in t._slots.values()}
            for c in rx.poll().chunks:
                got_b.append(c)
                rx.release(c)
            return len(got_b) == 6

        _wait(b_moves, what="b through the extents a leaves")
        _wait(lambda: "b" in tx.poll().finished, what="b finished")
        for c in held:  # a's staging bytes were never rewritten
            assert torch.equal(c.payload, a[c.seq_no].payload), c.seq_no
        for c in held:
            rx.release(c)  # the acks return a's extents (and credit) only now
        _wait(lambda: t._extents.used == 0, what="a's extents back")
        assert tx.poll().finished == []  # an aborted request reports nothing
        rx.abort("a")
        _assert_no_leak(tx, rx)
    finally:
        tx.close()
        rx.close()


def test_a_write_past_its_lease_fails_the_link_and_the_next_send_reconnects():
    cfg = _cfg(failure_timeout_s=1.0)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    dst = PagedKV(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64)
    try:
        tx.send(_chunk("warm", 0, True), dest=rx.endpoint)
        dst.allocate("warm", 16)
        assert pump(tx, rx, dst, ["warm"]) == ({}, {})
        agent = tx._nixl.agent
        agent.transfer = lambda h, notif_msg=b"": "PROC"  # a write that never completes
        agent.check_xfer_state = lambda h: "PROC"
        tx.send(_chunk("stuck", 0, True), dest=rx.endpoint)
        why, _ = wait_failed(tx, "stuck", 30)
        assert "not done within 1s (its lease)" in why, why
        del agent.transfer, agent.check_xfer_state  # the class's real methods again
        tx.send(_chunk("after", 0, True), dest=rx.endpoint)
        dst.allocate("after", 16)
        assert pump(tx, rx, dst, ["after"]) == ({}, {})
        assert tx.stats()["links"][rx.endpoint]["connects"] == 2
        # the failed link's region is dropped one failure timeout after it ended
        _wait(lambda: rx.stats()["staging_regions"] == 1, what="the old region dropped")
        assert rx.stats()["staging_regions_made"] == 2
        _assert_no_leak(tx, rx)
    finally:
        tx.close()
        rx.close()
    assert rx.stats()["staging_regions"] == 0 and tx.stats()["nixl"]["source_registrations"] == 0


def test_a_sender_without_the_secret_gets_no_grant_and_no_frame_in():
    rx = make_receiver(_cfg())
    tx = make_sender(_cfg(secret=b"not-the-cluster-secret-0000"))
    try:
        tx.send(_chunk("r", 0, True), dest=rx.endpoint)
        why, _ = wait_failed(tx, "r", 30)
        assert "cannot reach" in why
        s = rx.stats()
        assert s["auth_failures"] == 1 and s["staging_regions_made"] == 0
        assert s["frames_received"] == 0 and s["notifications"] == 0
        assert tx.stats()["nixl"]["remote_agents"] == 0  # it never saw the metadata
    finally:
        tx.close()
        rx.close()


def test_a_payload_corrupted_after_its_checksum_fails_the_request_on_both_ends():
    rx, tx = make_receiver(_cfg()), make_sender(_cfg())

    def tamper(t, dest, link):
        t.wire_tamper = lambda p: (p.chunk.payload + 1) if p.chunk.request_id == "bad" else None
        return t

    tx.wrap_transports(tamper)
    dst = PagedKV(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64)
    try:
        for rid in ("bad", "good"):
            dst.allocate(rid, 16)
            tx.send(_chunk(rid, 0, True), dest=rx.endpoint)
        tx_failed, rx_failed = pump(tx, rx, dst, ["bad", "good"])
        assert set(tx_failed) == {"bad"} and "checksum" in tx_failed["bad"]
        assert set(rx_failed) == {"bad"} and rx.stats()["checksum_failures"] == 1
        _assert_no_leak(tx, rx)
    finally:
        tx.close()
        rx.close()


def test_receiver_process_hung_then_killed_mid_stream_is_detected_within_the_timeout():
    check_hung_then_killed(_cfg(send_policy="paced", rate_bytes_per_s=40e6,
                                burst_bytes=1 << 20), _chunk)


_RX_CHILD = """
import sys, time
from kv_transfer import TransferConfig, make_receiver
rx = make_receiver(TransferConfig(connector="nixl", secret=bytes.fromhex(sys.argv[1]),
                                  failure_timeout_s=1.0))
print(rx.endpoint, flush=True)
while True:
    for c in rx.poll().chunks:
        rx.release(c)
    time.sleep(0.002)
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)


def test_a_decode_process_killed_mid_transfer_fails_only_its_requests():
    cfg = _cfg(send_policy="paced", rate_bytes_per_s=20e6, burst_bytes=256 << 10)
    child = _child(_RX_CHILD, SECRET.hex())
    rx, tx = make_receiver(cfg), make_sender(cfg)
    dst = PagedKV(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=512)
    try:
        far = child.stdout.readline().strip()
        assert far.startswith("nixl://"), "receiver process did not start"
        n = 120  # 4 KiB frames at 20 MB/s per link: both streams last ~25 ms + setup
        for i in range(n):
            tx.send_many([(_chunk("victim", i, i == n - 1), far),
                          (_chunk("bystander", i, i == n - 1), rx.endpoint)])
        dst.allocate("bystander", 16 * n)
        _wait(lambda: tx.stats()["links"][far]["bytes_acked"] > 0, what="the far link acks")
        os.kill(child.pid, signal.SIGKILL)
        why, _ = wait_failed(tx, "victim", 30)
        assert f"link to {far} failed" in why, why
        assert pump(tx, rx, dst, ["bystander"]) == ({}, {})
        s = tx.stats()
        assert s["links"][far]["failures"] == 1 and s["links"][rx.endpoint]["failures"] == 0
        assert s["requests_failed"] == 1 and s["requests_finished"] == 1
        tx._links.pop(far, None)  # the dead link's transport is gone; check the live one
        _assert_no_leak(tx, rx)
    finally:
        tx.close()
        rx.close()
        child.kill()
        child.wait(timeout=10)


_TX_CHILD = """
import sys, torch
from kv_transfer import KVChunk, TransferConfig, make_sender
tx = make_sender(TransferConfig(connector="nixl", secret=bytes.fromhex(sys.argv[1]),
                                failure_timeout_s=1.0, send_policy="paced",
                                rate_bytes_per_s=2e6, burst_bytes=64 << 10))
for i in range(2000):
    p = torch.randn(2, 2, 16, 2, 16)
    tx.send(KVChunk("p", i, 16 * i, 16 * (i + 1), p), dest=sys.argv[2])
    if i == 0:
        print("sending", flush=True)
import time
time.sleep(3600)
"""


def test_a_prefill_process_hung_then_killed_leaves_no_staging_region_behind():
    cfg = _cfg()
    rx = make_receiver(cfg)
    child = _child(_TX_CHILD, SECRET.hex(), rx.endpoint)
    try:
        assert child.stdout.readline().strip() == "sending"
        seen: list[KVChunk] = []

        def receiving():
            for c in rx.poll().chunks:
                seen.append(c)
                rx.release(c)
            return len(seen) >= 3

        _wait(receiving, what="the child's frames")
        assert rx.stats()["staging_regions"] == 1
        os.kill(child.pid, signal.SIGSTOP)  # hung: no notification, no heartbeat
        failed: dict[str, str] = {}
        _wait(lambda: failed.update(rx.poll().failed) or "p" in failed, what="p failed")
        assert "sender silent for 1s" in failed["p"], failed
        os.kill(child.pid, signal.SIGKILL)
        _wait(lambda: rx.stats()["staging_regions"] == 0, what="the region dropped")
        s = rx.stats()
        assert s["inflight_bytes"] == 0 and s["active_requests"] == 0 and s["staging_bytes"] == 0
    finally:
        child.kill()
        child.wait(timeout=10)
        rx.close()
