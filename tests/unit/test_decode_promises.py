"""Decode-side promises and KV intake under a full pool, driven step by step: a promise
holds (running requests grow only into unpromised blocks, else the newest is preempted),
a started request keeps its headroom, and a bad chunk fails its own request only while
every chunk of the poll is still written or released. Every test ends with a leak check."""

from __future__ import annotations

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.scheduler import DecodeScheduler, DecodeSchedulerConfig
from engine.block_manager import BlockManager
from engine.request import RequestStatus
from kv_transfer.base import KVChunk, ReceiveEvents
from runtime.messages import DecodeTask, EventKind
from tests.engine_fakes import ScriptedReceiver
from tests.pd_harness import engine_cfg, greedy

S = RequestStatus


def _sched(num_blocks: int, headroom: int = 0) -> DecodeScheduler:
    return DecodeScheduler(DecodeSchedulerConfig(headroom_tokens=headroom, max_model_len=1024),
                           BlockManager(num_blocks, 4, enable_prefix_caching=False))


def _arrive(s: DecodeScheduler, rid: str, end: int, first_token: int | None = None) -> None:
    """A chunk [.., end) arrives (what DecodeEngine._write does with the blocks)."""
    s.allocate_range(rid, end)
    p = s.pending[rid]
    p.received_tokens = end
    if first_token is not None:
        p.first_token = first_token
        s.start(rid)


def _decode(s: DecodeScheduler):
    """One decode step with a fake runner (token 7)."""
    items, preempted = s.schedule()
    for i in items:
        r = i.request
        r.num_cached_tokens += 1
        r.append_token(7)
        if r.is_finished:
            s.finish(r)
    assert s.promised_free_blocks() >= 0, "a promise was broken"
    s.bm.check_integrity()
    return items, preempted


def _leak_check(s: DecodeScheduler) -> None:
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0 and not s.pending and not s.running and not s.promises


def test_running_request_crossing_a_block_boundary_never_takes_blocks_promised_to_a_waiting_one():
    s = _sched(6)  # 6 blocks of 4 tokens, no headroom
    assert s.reserve(DecodeTask("a", 5, greedy(10)))  # 2 blocks
    _arrive(s, "a", 5, first_token=1)
    for _ in range(3):  # a decodes tokens 5, 6, 7: its 2 blocks are full
        _decode(s)
    assert s.running[0].num_cached_tokens == 8
    assert s.reserve(DecodeTask("b", 16, greedy(2)))  # the last 4 free blocks, promised
    _arrive(s, "b", 4)
    assert s.promised_free_blocks() == 0
    items, preempted = _decode(s)  # a needs a 3rd block: only b's promised ones are free
    assert [r.request_id for r in preempted] == ["a"] and items == []
    assert preempted[0].status == S.PREEMPTED
    _arrive(s, "b", 16, first_token=2)  # b's next chunk finds its blocks
    while s.running:
        _decode(s)
    _leak_check(s)


def test_started_request_keeps_its_headroom_and_decodes_into_it_without_preemption():
    s = _sched(8, headroom=8)
    assert s.reserve(DecodeTask("a", 4, greedy(9)))  # 4 + 8 tokens: 3 blocks promised
    before = s.promised_free_blocks()
    _arrive(s, "a", 4, first_token=1)
    assert s.promised_free_blocks() == before == 5  # starting released nothing
    assert s.reserve(DecodeTask("b", 12, greedy(9)))  # 12 + 8 tokens: the other 5
    assert not s.reserve(DecodeTask("c", 1, greedy(1)))
    _arrive(s, "b", 12, first_token=2)
    for _ in range(8):  # both decode through their headroom: nobody is preempted
        _, preempted = _decode(s)
        assert preempted == []
    while s.running:
        _decode(s)
    _leak_check(s)


def test_a_chunk_beyond_the_prompt_fails_in_the_scheduler_without_an_assert():
    s = _sched(8)
    assert s.reserve(DecodeTask("a", 8, greedy(2)))
    with pytest.raises(ValueError, match="beyond the announced prompt of 8 tokens"):
        s.allocate_range("a", 12)
    s.abort("a")
    _leak_check(s)


# ---- the engine's KV intake ------------------------------------------------------
def _engine(tiny_model, num_blocks=16):
    rx = ScriptedReceiver()
    eng = DecodeEngine("decode-0", engine_cfg(tiny_model, 4),
                       DecodeSchedulerConfig(max_model_len=1024, headroom_tokens=0), rx,
                       num_blocks)
    return eng, rx


def _chunk(eng, rid, start, end, seq, final=False, first=None, heads=None):
    m = eng.config.model
    payload = torch.zeros(m.num_layers, 2, end - start, heads or m.num_kv_heads, m.head_dim)
    return KVChunk(rid, seq, start, end, payload, is_final=final, first_token=first)


def _run(eng, max_steps=100):
    events = []
    for _ in range(max_steps):
        if not eng.has_work:
            return events
        events += eng.step()
    raise AssertionError("decode engine did not drain")


def test_a_bad_chunk_fails_its_own_request_and_every_chunk_of_the_poll_is_still_released(
        tiny_model):
    eng, rx = _engine(tiny_model)
    for rid in "abcd":
        assert eng.reserve(DecodeTask(rid, 8, greedy(3)))
    m = eng.config.model
    chunks = [
        _chunk(eng, "a", 0, 4, 0, heads=m.num_kv_heads + 1),  # cannot be written
        _chunk(eng, "b", 0, 8, 0, final=True, first=5),  # fine
        _chunk(eng, "a", 4, 8, 1, final=True, first=5),  # a later chunk of the failed one
        _chunk(eng, "c", 0, 12, 0, final=True, first=5),  # beyond c's 8-token prompt
    ]
    rx.script.append(ReceiveEvents(chunks=chunks, failed=[("d", "link dropped")],
                                   completed=["b"]))
    events = eng.step()
    failed = {e.leg_id: e.message for e in events if e.kind == EventKind.FAILED}
    assert set(failed) == {"a", "c", "d"}
    assert "could not be written" in failed["a"]
    assert "beyond the announced prompt of 8 tokens" in failed["c"]
    assert failed["d"] == "KV receive failed: link dropped"
    assert [c.request_id for c in rx.released] == ["a", "b", "a", "c"]  # all of the poll
    assert {"a", "c"} <= set(rx.aborted)  # their later frames are dropped (credit back)
    assert [e.leg_id for e in events if e.kind == EventKind.TOKENS] == ["b"]  # b went on
    events = _run(eng)
    assert [e.finish_reason for e in events if e.kind == EventKind.TOKENS][-1] == "length"
    eng.bm.check_integrity()
    assert eng.bm.num_used_blocks == 0 and not eng.scheduler.promises


def test_a_final_chunk_without_a_valid_first_token_fails_the_request(tiny_model):
    eng, rx = _engine(tiny_model)
    assert eng.reserve(DecodeTask("a", 4, greedy(3)))
    assert eng.reserve(DecodeTask("b", 4, greedy(3)))
    vocab = eng.config.model.vocab_size
    rx.script.append(ReceiveEvents(chunks=[
        _chunk(eng, "a", 0, 4, 0, final=True, first=vocab),
        _chunk(eng, "b", 0, 4, 0, final=True, first=None)], completed=["a", "b"]))
    failed = {e.leg_id: e.message for e in eng.step() if e.kind == EventKind.FAILED}
    assert f"first token {vocab}" in failed["a"] and "first token None" in failed["b"]
    assert not eng.has_work and eng.bm.num_used_blocks == 0


def test_an_out_of_range_chunk_is_reported_not_dropped_silently(tiny_model):
    eng, rx = _engine(tiny_model)
    assert eng.reserve(DecodeTask("a", 8, greedy(3)))
    rx.script.append(ReceiveEvents(chunks=[_chunk(eng, "a", 4, 12, 0)]))
    events = eng.step()
    assert [(e.kind, e.leg_id) for e in events] == [(EventKind.FAILED, "a")]
    assert "KV chunk [4, 12) is beyond the announced prompt of 8 tokens" in events[0].message
    assert rx.released and rx.aborted == ["a"]
    assert not eng.has_work and eng.bm.num_used_blocks == 0
