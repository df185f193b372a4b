"""KV-head ranges under TP: the transfer plan, frame head fields, and a receiver that
completes a request only once every head it serves arrived (issue 17)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kv_transfer import KVChunk, TransferConfig
from kv_transfer.heads import (
    HeadRange,
    head_replicas,
    rank_heads,
    receives_of,
    sends_of,
    transfer_plan,
)
from kv_transfer.inproc import InprocReceiver
from kv_transfer.wire import (
    AckStatus,
    FrameHeader,
    Piece,
    WireError,
    chunks_for_heads,
    decode,
    encode,
    header_for,
    split_chunk,
)
from tests.unit.test_kv_receiver import FakeLink


# ---- the plan -------------------------------------------------------------------------
def _plan(h, p, d):
    return [(t.prefill_rank, t.decode_rank, t.heads.start, t.heads.end) for t in
            transfer_plan(h, p, d)]


def test_plan_of_the_three_issue_cases_and_a_replicated_one():
    assert _plan(2, 2, 1) == [(0, 0, 0, 1), (1, 0, 1, 2)]  # D rank 0 from both P ranks
    assert _plan(2, 1, 2) == [(0, 0, 0, 1), (0, 1, 1, 2)]  # P's heads split per D rank
    assert _plan(2, 2, 2) == [(0, 0, 0, 1), (1, 1, 1, 2)]  # rank i -> rank i
    # 2 KV heads over P TP4: ranks 0,1 hold head 0, ranks 2,3 head 1
    assert [rank_heads(2, 4, r)[:2] for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert _plan(2, 4, 1) == [(0, 0, 0, 1), (2, 0, 1, 2)]
    # decode replicas of a head get it from different prefill replicas (spread load)
    assert _plan(2, 4, 4) == [(0, 0, 0, 1), (1, 1, 0, 1), (2, 2, 1, 2), (3, 3, 1, 2)]
    assert _plan(6, 2, 3) == [(0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4), (1, 2, 4, 6)]
    assert [t.share for t in transfer_plan(6, 2, 3)] == [2 / 6, 1 / 6, 1 / 6, 2 / 6]


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 4, 6, 8, 12])
def test_every_decode_rank_gets_each_of_its_heads_exactly_once_from_a_holder(num_kv_heads):
    checked = 0
    for p_tp, d_tp in itertools.product(range(1, 13), repeat=2):
        try:
            plan = transfer_plan(num_kv_heads, p_tp, d_tp)
        except ValueError:
            continue
        checked += 1
        pairs = [(t.prefill_rank, t.decode_rank) for t in plan]
        assert len(pairs) == len(set(pairs)), "a rank pair exchanges one range at most"
        assert sum(t.share for t in plan) == pytest.approx(1.0)
        for d in range(d_tp):
            want = rank_heads(num_kv_heads, d_tp, d)
            got = sorted(t.heads[:2] for t in receives_of(plan, d))
            assert got[0][0] == want.start and got[-1][1] == want.end
            assert all(a[1] == b[0] for a, b in itertools.pairwise(got)), got  # tiles
        for t in plan:
            have = rank_heads(num_kv_heads, p_tp, t.prefill_rank)
            assert have.start <= t.heads.start < t.heads.end <= have.end
        if num_kv_heads < p_tp:  # every head is sent by some replica, the load spread
            senders = {t.prefill_rank for t in plan}
            assert len(senders) == min(p_tp, max(num_kv_heads, d_tp))
        assert all(0 <= t.prefill_rank < p_tp and 0 <= t.decode_rank < d_tp for t in plan)
    assert checked >= 8


@pytest.mark.parametrize(("h", "p", "d", "words"), [
    (3, 2, 1, "prefill tensor_parallel_size=2: 2 must divide 3"),
    (4, 1, 3, "decode tensor_parallel_size=3: 3 must divide 4"),
    (2, 3, 1, "replicated over prefill tensor_parallel_size=3: 3 must be a multiple of 2"),
    (4, 6, 2, "replicated over prefill tensor_parallel_size=6"),
    (2, 0, 1, "prefill tensor_parallel_size must be an int >= 1"),
    (0, 1, 1, "num_kv_heads must be an int >= 1"),
])
def test_non_divisible_head_counts_give_a_clear_error(h, p, d, words):
    with pytest.raises(ValueError, match=words):
        transfer_plan(h, p, d)


def test_rank_heads_and_replicas_agree():
    for h, tp in [(8, 4), (2, 8), (9, 3), (3, 3), (1, 4)]:
        for head in range(h):
            assert all(head in range(*rank_heads(h, tp, r)[:2]) for r in head_replicas(h, tp, head))
    with pytest.raises(ValueError, match="rank must be in"):
        rank_heads(4, 2, 2)


# ---- chunks and frames ----------------------------------------------------------------
def _chunk(heads=(0, 2, 2), tokens=4, seq=0, final=False, rid="r", layers=1):
    hs, he, hn = heads
    payload = torch.arange(layers * 2 * tokens * (he - hs) * 3, dtype=torch.float32).view(
        layers, 2, tokens, he - hs, 3) + 100 * hs
    return KVChunk(rid, seq, seq * tokens, (seq + 1) * tokens, payload, is_final=final,
                   first_token=5 if final else None, head_start=hs, num_kv_heads=hn)


def test_chunk_head_range_is_validated_and_defaults_to_every_head():
    assert _chunk((0, 2, 0)).heads == HeadRange(0, 2, 2)  # 0 = the payload holds all heads
    assert _chunk((1, 3, 4)).heads == HeadRange(1, 3, 4)
    for bad in [(3, 5, 4), (1, 3, 0)]:
        with pytest.raises(ValueError, match="must lie within the model's"):
            _chunk(bad)


def test_frames_carry_the_head_range_and_splitting_keeps_it():
    c = _chunk((2, 4, 8), tokens=64, layers=4)
    pieces = split_chunk(c, c.nbytes // 3)
    assert len(pieces) > 1 and all(p.chunk.heads == HeadRange(2, 4, 8) for p in pieces)
    msg = decode(b"".join(bytes(b) for b in encode(pieces[1])))
    assert (msg.header.head_start, msg.header.head_end, msg.header.num_kv_heads) == (2, 4, 8)
    assert torch.equal(msg.payload, pieces[1].chunk.payload)


def _wire(c: KVChunk) -> dict:
    return header_for(Piece(c, 0, 1)).to_wire()


def test_a_header_without_head_fields_is_a_single_rank_frame_of_every_head():
    d = _wire(_chunk((0, 2, 0)))
    for k in ("hs", "he", "hn"):
        del d[k]
    h = FrameHeader.from_wire(d)
    assert h.heads == HeadRange(0, 2, 2)


@pytest.mark.parametrize(("change", "words"), [
    ({"hs": None}, "'hs' must be an int"),
    ({"he": True}, "'he' must be an int"),
    ({"hs": 1, "he": 1}, "'he' must be an int|not within"),
    ({"hs": 2, "he": 4, "hn": 3}, "not within"),
    ({"hs": 0, "he": 1}, "has 2 KV heads but the head range"),
    ({"hn": 0}, "'hn' must be an int"),
])
def test_bad_head_fields_are_rejected_by_name(change, words):
    d = _wire(_chunk((2, 4, 8)))
    d.update(change)
    with pytest.raises(WireError, match=words):
        FrameHeader.from_wire(d)


def test_a_header_with_only_some_head_fields_is_rejected():
    d = _wire(_chunk((2, 4, 8)))
    del d["hn"]
    with pytest.raises(WireError, match="not all of 'hs', 'he', 'hn'"):
        FrameHeader.from_wire(d)


def test_chunks_for_heads_cuts_one_prefill_ranks_chunk_per_decode_rank():
    plan = transfer_plan(4, 1, 2)
    c = _chunk((0, 4, 4))
    (c0, d0), (c1, d1) = chunks_for_heads(c, sends_of(plan, 0), ["ep0", "ep1"])
    assert (d0, d1) == ("ep0", "ep1") and c0.heads == (0, 2, 4) and c1.heads == (2, 4, 4)
    assert torch.equal(c1.payload, c.payload[:, :, :, 2:4]) and c1.payload.is_contiguous()
    same = chunks_for_heads(_chunk((2, 4, 4)), sends_of(transfer_plan(4, 2, 1), 1), ["ep"])
    assert same[0][0].heads == (2, 4, 4)
    with pytest.raises(ValueError, match="not within the chunk's heads"):
        chunks_for_heads(_chunk((0, 2, 4)), sends_of(plan, 0), ["ep0", "ep1"])


# ---- receiver completion: every head range must arrive ----------------------------------
def _feed(rx, link, c: KVChunk, tx: int = 1):
    rx._accept(link, header_for(Piece(c, 0, 1, tx=tx)), c.payload)


def test_a_request_completes_only_when_every_head_range_of_the_receiver_arrived():
    rx, p0, p1 = InprocReceiver(TransferConfig()), FakeLink("p0"), FakeLink("p1")
    rx.set_head_range(HeadRange(0, 2, 2))
    _feed(rx, p0, _chunk((0, 1, 2), seq=0))
    _feed(rx, p0, _chunk((0, 1, 2), seq=1, final=True), tx=2)
    ev = rx.poll()
    assert len(ev.chunks) == 2 and ev.completed == []  # heads [1, 2) still missing
    _feed(rx, p1, _chunk((1, 2, 2), seq=0))
    assert rx.poll().completed == []
    _feed(rx, p1, _chunk((1, 2, 2), seq=1, final=True), tx=2)
    ev = rx.poll()
    assert ev.completed == ["r"] and {c.heads for c in ev.chunks} == {HeadRange(1, 2, 2)}
    assert rx.stats()["active_requests"] == 0
    rx.close()


def test_without_a_configured_range_the_model_s_heads_must_all_arrive():
    rx, p0, p1 = InprocReceiver(TransferConfig()), FakeLink("p0"), FakeLink("p1")
    _feed(rx, p1, _chunk((2, 4, 4), final=True))
    assert rx.poll().completed == []
    _feed(rx, p0, _chunk((0, 2, 4), final=True))
    assert rx.poll().completed == ["r"]
    _feed(rx, p0, _chunk((0, 2, 2), final=True, rid="legacy"))  # a single-rank sender
    assert rx.poll().completed == ["legacy"]
    rx.close()


@pytest.mark.parametrize(("first", "second", "words"), [
    ((0, 2, 4), (1, 3, 4), "overlap heads"),
    ((0, 2, 4), (2, 4, 8), "disagree with the request's earlier frames"),
])
def test_overlapping_or_inconsistent_head_ranges_fail_the_request(first, second, words):
    rx, p0, p1 = InprocReceiver(TransferConfig()), FakeLink("p0"), FakeLink("p1")
    _feed(rx, p0, _chunk(first))
    _feed(rx, p1, _chunk(second))
    ev = rx.poll()
    assert ev.failed and words in ev.failed[0][1] and ev.chunks == []
    assert [a.status for a in p0.acks] == [AckStatus.FAILED]  # credit of the held frame
    assert [a.status for a in p1.acks] == [AckStatus.FAILED]
    assert rx.stats()["head_range_failures"] == 1 and rx.stats()["inflight_bytes"] == 0
    rx.close()


def test_heads_outside_the_receivers_range_fail_the_request():
    rx, link = InprocReceiver(TransferConfig()), FakeLink()
    rx.set_head_range(rank_heads(4, 2, 1))  # decode rank 1 of TP2: heads [2, 4)
    _feed(rx, link, _chunk((0, 2, 4), final=True))
    ev = rx.poll()
    assert ev.failed == [("r", "KV heads [0, 2) of 4 are not this receiver's heads [2, 4) of 4")]
    _feed(rx, link, _chunk((2, 4, 4), final=True, rid="ok"))
    assert rx.poll().completed == ["ok"]
    with pytest.raises(ValueError, match="must satisfy"):
        rx.set_head_range(HeadRange(2, 2, 4))
    rx.close()


def test_one_prefill_link_dropping_fails_a_request_the_other_link_streams_too():
    rx, p0, p1 = InprocReceiver(TransferConfig()), FakeLink("p0"), FakeLink("p1")
    _feed(rx, p0, _chunk((0, 1, 2), final=True))
    _feed(rx, p1, _chunk((1, 2, 2)))
    for c in rx.poll().chunks:
        rx.release(c)
    rx._link_closed(p1, "reset")
    assert rx.poll().failed == [("r", "link dropped before final chunk: reset")]
    assert rx.stats()["active_requests"] == 0 and rx.stats()["inflight_bytes"] == 0
    rx.close()


def test_a_second_link_for_the_same_heads_is_discarded():
    rx, p0, p1 = InprocReceiver(TransferConfig()), FakeLink("p0"), FakeLink("p1")
    _feed(rx, p0, _chunk((0, 1, 2)))
    _feed(rx, p1, _chunk((0, 1, 2), seq=1))
    assert [(a.status, "already streaming" in a.reason) for a in p1.acks] == [
        (AckStatus.DROPPED, True)]
    rx.close()
