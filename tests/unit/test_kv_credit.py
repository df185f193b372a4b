"""Credit accounting: every transmission's credit comes back exactly once, whatever the ack
(OK, DROPPED, FAILED, DUPLICATE), also when a request id is sent again after its request
completed on the receiver, and when copies of a frame arrive late."""

from __future__ import annotations

import torch

from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.inproc import InprocReceiver
from kv_transfer.testing import PagedKV, make_chunks, pump
from kv_transfer.wire import AckStatus, Piece, header_for
from tests.unit.test_kv_receiver import FakeLink

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64}  # 1 KiB of KV per token


def _frame(rid: str, seq: int, tx: int, final: bool = False):
    payload = torch.full((1, 2, 4, 1, 2), float(seq))
    chunk = KVChunk(rid, seq, seq * 4, seq * 4 + 4, payload, is_final=final,
                    first_token=3 if final else None)
    return header_for(Piece(chunk, 0, 1, tx=tx)), payload


def test_a_frame_reusing_a_completed_request_id_is_dropped_with_credit_not_called_a_copy():
    rx, link = InprocReceiver(TransferConfig()), FakeLink()
    rx._accept(link, *_frame("r", 0, tx=1))
    rx._accept(link, *_frame("r", 1, tx=2, final=True))
    ev = rx.poll()
    assert ev.completed == ["r"]
    for c in ev.chunks:
        rx.release(c)
    rx._accept(link, *_frame("r", 1, tx=2, final=True))  # a late copy of transmission 2
    rx._accept(link, *_frame("r", 0, tx=7))  # a new frame that reuses the id
    other = FakeLink("other")
    rx._accept(other, *_frame("r", 0, tx=1))  # another sender's frame with the same id
    assert rx.poll().chunks == []
    assert [(a.tx, a.status) for a in link.acks] == [
        (1, AckStatus.OK), (2, AckStatus.OK), (2, AckStatus.DUPLICATE), (7, AckStatus.DROPPED)]
    assert "completed" in link.acks[-1].reason
    assert [(a.tx, a.status) for a in other.acks] == [(1, AckStatus.DROPPED)]
    # exactly one credit-carrying ack per transmission
    credit = [(id(lk), a.tx) for lk in (link, other) for a in lk.acks
              if a.status != AckStatus.DUPLICATE]
    assert len(credit) == len(set(credit)) == 4
    assert rx.stats()["duplicates"] == 1 and rx.stats()["inflight_bytes"] == 0
    rx.close()


def test_a_copy_of_a_held_frame_is_a_duplicate_and_its_original_carries_the_credit():
    rx, link = InprocReceiver(TransferConfig()), FakeLink()
    rx._accept(link, *_frame("r", 0, tx=4))
    rx._accept(link, *_frame("r", 0, tx=4))  # copy while the original is unreleased
    rx._accept(link, *_frame("r", 0, tx=5))  # same key, another transmission: not a copy
    [chunk] = rx.poll().chunks
    rx.release(chunk)
    assert [(a.tx, a.status) for a in link.acks] == [
        (4, AckStatus.DUPLICATE), (5, AckStatus.DROPPED), (4, AckStatus.OK)]
    rx.close()


def test_resending_a_completed_request_id_returns_every_credit_and_fails_it_visibly():
    # the window holds one frame: a credit that never came back would stall the link
    cfg = TransferConfig(max_frame_bytes=64 << 10, credit_window_bytes=64 << 10)
    src = PagedKV(**SHAPE, block_size=16, num_blocks=64)
    dst = PagedKV(**SHAPE, block_size=16, num_blocks=64)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    try:
        for rid in ("r", "next"):
            for cache in (src, dst):
                cache.allocate(rid, 48)
            src.fill_random(rid, 48, seed=len(rid))
        for c in make_chunks(src, "r", [0, 16, 48]):
            tx.send(c, dest=rx.endpoint)
        assert pump(tx, rx, dst, ["r"], timeout_s=10) == ({}, {})
        # the caller sends the same id again: the receiver took every frame of it already
        for c in make_chunks(src, "r", [0, 16, 48]):
            tx.send(c, dest=rx.endpoint)
        tx_failed, rx_failed = pump(tx, rx, dst, ["r"], timeout_s=10)
        assert list(tx_failed) == ["r"] and "completed" in tx_failed["r"] and not rx_failed
        assert tx.stats()["inflight_bytes"] == 0
        for c in make_chunks(src, "next", [0, 20, 48]):  # the link still carries requests
            tx.send(c, dest=rx.endpoint)
        assert pump(tx, rx, dst, ["next"], timeout_s=10) == ({}, {})
        assert torch.equal(dst.export("next", 0, 48), src.export("next", 0, 48))
        s, r = tx.stats(), rx.stats()
        assert s["inflight_bytes"] == s["queued_bytes"] == s["active_requests"] == 0
        assert r["inflight_bytes"] == r["active_requests"] == r["inbox_chunks"] == 0
    finally:
        tx.close()
        rx.close()
