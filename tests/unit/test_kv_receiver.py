"""Receiver faults, frame by frame: checksum, duplicates, reordering, unknown/aborted requests."""

from __future__ import annotations

import dataclasses

import torch

from kv_transfer import KVChunk, TransferConfig
from kv_transfer.inproc import InprocReceiver
from kv_transfer.receiver import RxLink
from kv_transfer.wire import Ack, AckStatus, Piece, header_for


class FakeLink(RxLink):
    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.acks: list[Ack] = []

    def send_acks(self, acks: list[Ack]) -> None:
        self.acks.extend(acks)

    def statuses(self) -> list[tuple[str, int, int]]:
        return [(a.request_id, a.seq_no, a.status) for a in self.acks]


def _frame(rid: str, seq: int, final: bool = False, part: int = 0, num_parts: int = 1):
    payload = torch.full((1, 2, 4, 1, 2), float(seq * 10 + part))
    chunk = KVChunk(rid, seq, seq * 4, seq * 4 + 4, payload, is_final=final,
                    first_token=3 if final else None, layer_start=part)  # part p = layer p
    return header_for(Piece(chunk, part, num_parts)), payload


def _rx(**kw) -> InprocReceiver:
    return InprocReceiver(TransferConfig(**kw))


def test_checksum_mismatch_fails_the_request_and_never_delivers_it():
    rx, link = _rx(), FakeLink()
    h0, p0 = _frame("r", 0)
    rx._accept(link, h0, p0)
    h1, p1 = _frame("r", 1, final=True)
    rx._accept(link, dataclasses.replace(h1, checksum=h1.checksum ^ 1), p1)
    ev = rx.poll()
    assert ev.chunks == [] and ev.completed == []  # the good chunk 0 is withdrawn too
    assert ev.failed == [("r", ev.failed[0][1])] and "checksum mismatch" in ev.failed[0][1]
    # the bad frame and the withdrawn one both return their credit, as failures
    assert sorted(link.statuses()) == [("r", 0, AckStatus.FAILED), ("r", 1, AckStatus.FAILED)]
    rx._accept(link, *_frame("r", 2, final=True))  # later frames of it are discarded
    assert rx.poll().chunks == [] and link.acks[-1].status == AckStatus.DROPPED
    assert rx.stats()["checksum_failures"] == 1
    rx.close()


def test_duplicate_and_out_of_order_frames_are_idempotent():
    rx, link = _rx(), FakeLink()
    order = [(2, 0, True), (0, 1, False), (0, 0, False), (2, 0, True), (1, 0, False),
             (0, 1, False)]  # (seq, part, final): seq 0 comes as 2 parts, copies of two
    for seq, part, final in order:
        rx._accept(link, *_frame("r", seq, final, part, 2 if seq == 0 else 1))
    ev = rx.poll()
    got = sorted((c.seq_no, c.payload.flatten()[0].item()) for c in ev.chunks)
    assert got == [(0, 0.0), (0, 1.0), (1, 10.0), (2, 20.0)]
    assert ev.completed == ["r"]
    # the second copy of (0, 1) came after completion: still just a duplicate
    assert link.statuses() == [("r", 2, AckStatus.DUPLICATE), ("r", 0, AckStatus.DUPLICATE)]
    assert rx.stats()["duplicates"] == 2
    for c in ev.chunks:
        rx.release(c)
    assert sorted(a.status for a in link.acks).count(AckStatus.OK) == 4
    rx._accept(link, *_frame("r", 1))  # a replay after completion is discarded
    assert rx.poll().chunks == [] and link.acks[-1].status == AckStatus.DUPLICATE
    rx.close()


def test_request_is_complete_only_when_every_seq_up_to_the_final_one_arrived():
    rx, link = _rx(), FakeLink()
    rx._accept(link, *_frame("r", 3, final=True))
    rx._accept(link, *_frame("r", 0))
    rx._accept(link, *_frame("r", 2))
    assert rx.poll().completed == []
    rx._accept(link, *_frame("r", 1))
    assert rx.poll().completed == ["r"]
    rx.close()


def test_aborted_and_unknown_requests_are_discarded_and_credited():
    rx, link = _rx(require_expect=True), FakeLink()
    rx._accept(link, *_frame("stranger", 0))
    rx.expect("known")
    rx._accept(link, *_frame("known", 0))
    delivered = rx.poll().chunks
    assert [c.request_id for c in delivered] == ["known"]
    rx._accept(link, *_frame("known", 1))  # in the inbox, not yet polled
    rx.abort("known")
    rx._accept(link, *_frame("known", 2, final=True))
    assert rx.poll().chunks == []
    rx.release(delivered[0])  # after abort: a no-op, its credit went back already
    assert link.statuses() == [
        ("stranger", 0, AckStatus.DROPPED),
        ("known", 0, AckStatus.DROPPED), ("known", 1, AckStatus.DROPPED),
        ("known", 2, AckStatus.DROPPED),
    ]
    assert "not expected" in link.acks[0].reason and "aborted" in link.acks[-1].reason
    assert rx.stats()["inflight_bytes"] == 0
    rx.close()


def test_a_request_stays_bound_to_the_link_it_started_on():
    rx, a, b = _rx(), FakeLink("a"), FakeLink("b")
    rx._accept(a, *_frame("r", 0))
    rx._accept(b, *_frame("r", 1, final=True))
    assert len(rx.poll().chunks) == 1 and b.acks[0].status == AckStatus.DROPPED
    rx._link_closed(a, "reset by peer")
    ev = rx.poll()
    assert ev.failed == [("r", "link dropped before final chunk: reset by peer")]
    rx.close()
