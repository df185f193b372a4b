"""The connector contract end to end, for every connector that runs in one process
(inproc, tcp, torchdist, nixl): byte-exact round trips and the sender's lifecycle."""

from __future__ import annotations

import importlib.util
import random
import threading
import time

import pytest
import torch

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.registry import CONNECTORS as CONNECTORS_REGISTRY
from kv_transfer.testing import PagedKV, make_chunks, pump, random_bounds

SHAPE = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64}  # 4 KiB of KV per token
SECRET = b"connector-contract-tests-secret-0123"
HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None
CONNECTORS = ["inproc", "tcp", "torchdist",
              pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="no nixl"))]
NOWHERE = {"inproc": "inproc://no-such-receiver", "tcp": "tcp://127.0.0.1:1",
           "torchdist": "torchdist://127.0.0.1:1", "nixl": "nixl://127.0.0.1:1"}


def _cfg(connector: str, **kw) -> TransferConfig:
    if CONNECTORS_REGISTRY.get(connector).requires_secret:  # tcp, nixl
        kw["secret"] = SECRET
    return TransferConfig(connector=connector, **kw)


@pytest.fixture(params=CONNECTORS)
def connector(request) -> str:
    return request.param


def _caches(src_block: int, dst_block: int) -> tuple[PagedKV, PagedKV]:
    return (PagedKV(**SHAPE, block_size=src_block, num_blocks=4096 // src_block),
            PagedKV(**SHAPE, block_size=dst_block, num_blocks=4096 // dst_block))


@pytest.mark.parametrize(("src_block", "dst_block"), [(16, 32), (32, 16), (16, 48)])
@pytest.mark.parametrize("policy", ["eager", "at_end", "paced"])
def test_round_trip_random_ranges_across_block_sizes_is_byte_exact(src_block, dst_block, policy,
                                                                   connector):
    # 64 KiB frames force chunks to be split by layer and by token range on the way
    cfg = _cfg(connector, send_policy=policy, rate_bytes_per_s=200e6, max_frame_bytes=64 << 10,
                         credit_window_bytes=256 << 10, send_queue="wfq")
    rng = random.Random(src_block * 7 + dst_block)
    src, dst = _caches(src_block, dst_block)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        lens = {f"r{i}": rng.randint(1, 300) for i in range(5)}
        chunks = []
        for i, (rid, n) in enumerate(lens.items()):
            src.allocate(rid, n)
            src.fill_random(rid, n, seed=i)
            dst.allocate(rid, n)
            chunks.append(make_chunks(src, rid, random_bounds(rng, n) if n > 1 else [0, 1],
                                      tenant=f"t{i % 2}"))
        while any(chunks):  # interleave requests, each in seq order
            c = rng.choice([c for c in chunks if c])
            tx.send(c.pop(0), dest=rx.endpoint)
        assert pump(tx, rx, dst, lens) == ({}, {})
        for rid, n in lens.items():
            assert torch.equal(dst.export(rid, 0, n), src.export(rid, 0, n)), rid
        stats = tx.stats()
        link = stats["links"][rx.endpoint]
        assert link["peak_inflight_bytes"] <= cfg.credit_window_bytes
        assert stats["requests_finished"] == 5 and stats["inflight_bytes"] == 0
    finally:
        tx.close()
        rx.close()


def _one(rid: str, seq: int, final: bool, tokens: int = 8) -> KVChunk:
    p = torch.full((2, 2, tokens, 1, 8), float(seq))
    return KVChunk(rid, seq, seq * tokens, (seq + 1) * tokens, p, is_final=final,
                   first_token=5 if final else None)


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_a_request_finishes_only_when_the_owner_released_every_frame(connector):
    cfg = _cfg(connector)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        for s in range(3):
            tx.send(_one("r", s, s == 2), dest=rx.endpoint)
        got = []
        _wait(lambda: got.extend(rx.poll().chunks) or len(got) == 3)
        time.sleep(0.05)
        assert tx.poll().finished == [] and tx.stats()["inflight_bytes"] == 3 * got[0].nbytes
        for c in got[:2]:
            rx.release(c)
            rx.release(c)  # idempotent
        time.sleep(0.05)
        assert tx.poll().finished == []
        rx.release(got[2])
        ev = []
        _wait(lambda: ev.extend(tx.poll().finished) or ev == ["r"])
        assert tx.stats()["inflight_bytes"] == 0 and rx.stats()["inflight_bytes"] == 0
    finally:
        tx.close()
        rx.close()


def test_sender_abort_drops_queued_frames_and_reports_nothing(connector):
    cfg = _cfg(connector, send_policy="at_end")
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        tx.send(_one("gone", 0, False), dest=rx.endpoint)
        tx.send(_one("kept", 0, True), dest=rx.endpoint)
        assert tx.stats()["held_bytes"] == _one("gone", 0, False).nbytes
        tx.abort("gone")
        tx.send(_one("gone", 1, True), dest=rx.endpoint)  # late chunk of an aborted request
        _, _ = pump(tx, rx, PagedKVStub(), ["kept"])
        assert tx.stats()["held_bytes"] == 0 and tx.stats()["queued_bytes"] == 0
        assert rx.stats()["frames_received"] == 1
        time.sleep(0.05)
        ev = tx.poll()
        assert ev.finished == [] and ev.failed == []
    finally:
        tx.close()
        rx.close()


def test_sender_rejects_contract_violations(connector):
    cfg = _cfg(connector)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        tx.send(_one("r", 0, False), dest=rx.endpoint)
        with pytest.raises(ValueError, match="sent twice"):
            tx.send(_one("r", 0, False), dest=rx.endpoint)
        # a batch with one bad item queues nothing of it
        with pytest.raises(ValueError, match="sent twice"):
            tx.send_many([(_one("r", 1, False), rx.endpoint), (_one("r", 1, True), rx.endpoint)])
        assert tx.stats()["requests"]["r"]["bytes_queued"] == _one("r", 0, False).nbytes
        tx.send(_one("r", 1, True), dest=rx.endpoint)
        with pytest.raises(ValueError, match="after its final chunk"):
            tx.send(_one("r", 2, True), dest=rx.endpoint)
        # another receiver (a decode TP rank) joining after the final chunk would let the
        # request finish before that receiver got anything
        with pytest.raises(ValueError, match="new receiver"):
            tx.send(_one("r", 0, True), dest=NOWHERE[connector])
    finally:
        tx.close()
        rx.close()


def test_unreachable_or_closed_receiver_fails_its_requests(connector):
    cfg = _cfg(connector, failure_timeout_s=1.0, handshake_timeout_s=1.0)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        tx.send(_one("nowhere", 0, True), dest=NOWHERE[connector])
        tx.send(_one("cut", 0, False), dest=rx.endpoint)
        _wait(lambda: len(rx.poll().chunks) == 1)
        rx.close()  # receiver gone mid-request
        failed: dict[str, str] = {}
        _wait(lambda: failed.update(tx.poll().failed) or len(failed) == 2)
        assert "cannot reach" in failed["nowhere"] and "receiver closed" in failed["cut"]
        assert tx.stats()["link_failures"] == 2
    finally:
        tx.close()
        rx.close()


def test_sender_close_reports_unfinished_requests_failed(connector):
    cfg = _cfg(connector, send_policy="at_end")
    rx, tx = make_receiver(cfg), make_sender(cfg)
    tx.send(_one("r", 0, False), dest=rx.endpoint)
    tx.close()
    assert tx.poll().failed == [("r", "sender closed")]
    with pytest.raises(RuntimeError):
        tx.send(_one("r", 1, True), dest=rx.endpoint)
    rx.close()


class PagedKVStub:
    def import_chunk(self, chunk: KVChunk) -> None:
        pass


def test_idle_owner_can_block_in_wait_until_a_chunk_arrives(connector):
    cfg = _cfg(connector)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        t0 = time.monotonic()
        assert rx.wait(0.05) is False and time.monotonic() - t0 >= 0.04
        tx.send(_one("r", 0, True), dest=rx.endpoint)
        assert rx.wait(10.0) is True
        assert [c.request_id for c in rx.poll().chunks] == ["r"]
    finally:
        tx.close()
        rx.close()


def test_the_arrival_hook_runs_once_per_arrival_on_the_storing_thread(connector):
    """The decode worker's wake-up: every chunk runs the hook (on the link's thread for
    tcp); a hook that raises does not end the link; a cleared hook is not called."""
    cfg = _cfg(connector)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    calls: list[str] = []
    arrived = threading.Semaphore(0)

    def hook():
        calls.append(threading.current_thread().name)
        arrived.release()
        if len(calls) == 1:
            raise RuntimeError("a broken owner")

    rx.set_arrival_hook(hook)
    try:
        tx.send(_one("r", 0, False), dest=rx.endpoint)
        assert arrived.acquire(timeout=10.0)
        tx.send(_one("r", 1, True), dest=rx.endpoint)
        assert arrived.acquire(timeout=10.0)
        assert [c.seq_no for c in rx.poll().chunks] == [0, 1]
        assert len(calls) == 2
        if connector == "tcp":
            assert all(name.startswith("kv-rx-link") for name in calls)
        rx.set_arrival_hook(None)
        tx.send(_one("q", 0, True), dest=rx.endpoint)
        assert rx.wait(10.0) and len(calls) == 2
    finally:
        tx.close()
        rx.close()
