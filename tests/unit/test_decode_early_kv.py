"""KV that reaches a decode worker before its leg's reserve (the router sends reserve and
the prefill's add at once): held in EarlyKV, written in order when the reserve comes
(tokens exact), dropped and counted when the reserve is refused, the leg is aborted, its
reserve never comes (expiry) or a bound is hit; an id whose held KV was dropped never
picks it up again. Every case is built by construction (frames first, then the reserve)
and ends with a leak check on both engines and an empty EarlyKV."""

from __future__ import annotations

import pytest
import torch

from decode_worker.early_kv import EarlyKV, EarlyKVConfig
from decode_worker.engine import DecodeEngine
from decode_worker.scheduler import DecodeSchedulerConfig
from engine import LLM
from engine.request import SamplingParams
from kv_transfer.base import KVChunk, ReceiveEvents
from kv_transfer.pacing import ManualClock
from runtime.messages import DecodeTask, EventKind, PrefillTask
from tests.engine_fakes import ScriptedReceiver
from tests.pd_harness import PDPair, engine_cfg, greedy

PROMPT = torch.randint(1, 2000, (40,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLM(str(tiny_model), block_size=16).generate([PROMPT], greedy(10))[0].token_ids


def _add_prefill(pair: PDPair, rid: str, prompt=PROMPT, sp=None) -> None:
    """Queue the leg on the prefill engine only: its reserve is sent later by the test."""
    eos = pair.prefill.config.model.eos_token_ids
    pair.prefill.add(PrefillTask(rid, tuple(prompt), sp or greedy(), pair.receiver.endpoint,
                                 eos))
    pair.outputs[rid] = []


def _reserve(pair: PDPair, rid: str, prompt=PROMPT, sp=None) -> bool:
    eos = pair.prefill.config.model.eos_token_ids
    return pair.decode.reserve(DecodeTask(rid, len(prompt), sp or greedy(), eos))


def _step_until(pair: PDPair, done, max_steps: int = 2000) -> None:
    """Step both engines until `done()` (the link threads deliver between steps)."""
    for _ in range(max_steps):
        if done():
            return
        pair.step()
        if not done():
            pair.receiver.wait(0.01)
    raise AssertionError("condition not reached")


def _held(pair: PDPair, rid: str):
    return pair.decode.early.held.get(rid)


def _early_empty(pair: PDPair) -> None:
    e = pair.decode.early
    assert not e.held and e.nbytes == 0 and e.nchunks == 0
    assert not pair.decode._ready and not pair.decode._ready_complete


def _receiver_empty(pair: PDPair) -> None:
    """Every frame the decode receiver took was released or dropped: no credit held."""
    rx = pair.receiver.stats()
    assert rx["inflight_bytes"] == 0 and rx["inbox_chunks"] == 0, rx


def _finish(pair: PDPair) -> None:
    pair.run()
    pair.leak_check()
    _early_empty(pair)
    _receiver_empty(pair)
    pair.close()


@pytest.mark.parametrize("arrived", ["all", "some"])
def test_kv_before_its_reserve_is_held_then_written_in_order_exactly(tiny_model, reference,
                                                                     arrived):
    pair = PDPair(tiny_model, chunk=8)
    _add_prefill(pair, "r0")
    if arrived == "all":  # every frame in: the receiver reported the leg complete
        _step_until(pair, lambda: _held(pair, "r0") is not None and _held(pair, "r0").complete)
    else:  # the first chunk only (the prefill runs 8 of 40 tokens per step)
        pair.prefill.step()
        _step_until(pair, lambda: pair.decode.early.nchunks >= 1)
        assert not _held(pair, "r0").complete
    held = _held(pair, "r0")
    assert held.nbytes == pair.decode.early.nbytes > 0
    assert "r0" not in pair.decode.scheduler.pending and pair.decode.bm.num_used_blocks == 0
    assert _reserve(pair, "r0")
    assert pair.decode.early.applied_legs == 1 and "r0" not in pair.decode.early
    _finish(pair)
    assert pair.outputs["r0"] == reference and pair.finished["r0"] == "length"
    assert sum(pair.decode.early.dropped_chunks.values()) == 0


@pytest.mark.parametrize("order", ["frames_then_refusal", "refusal_then_frames"])
def test_a_refused_reserve_drops_the_held_kv(tiny_model, order):
    pair = PDPair(tiny_model, chunk=64, d_blocks=8)  # 128 tokens of decode KV
    assert _reserve(pair, "hog", list(range(1, 101)))  # 100 + 10 tokens: 7 of 8 blocks
    _add_prefill(pair, "r0")
    if order == "frames_then_refusal":
        _step_until(pair, lambda: _held(pair, "r0") is not None and _held(pair, "r0").complete)
    assert not _reserve(pair, "r0")  # 40 + 10 tokens need 4 blocks, 1 is free
    assert "r0" not in pair.decode.early
    if order == "refusal_then_frames":  # they come after the refusal: discarded, not held
        _step_until(pair, lambda: not pair.prefill.jobs)
        assert "r0" not in pair.decode.early
    else:
        assert pair.decode.early.dropped_legs["refused"] == 1
    pair.prefill.abort("r0")  # the router aborts the prefill leg of a refused reserve
    pair.decode.abort("hog")
    pair.outputs.pop("r0")
    _finish(pair)


def test_abort_before_reserve_drops_held_kv_and_a_reused_id_starts_clean(tiny_model):
    pair = PDPair(tiny_model, chunk=64)
    _add_prefill(pair, "r0")
    _step_until(pair, lambda: _held(pair, "r0") is not None and _held(pair, "r0").complete)
    pair.prefill.abort("r0")
    assert not pair.decode.abort("r0")  # not reserved here: a tombstone
    assert pair.decode.early.dropped_legs["aborted"] == 1
    _early_empty(pair)
    assert not _reserve(pair, "r0")  # the overtaken reserve is swallowed by the tombstone
    assert _reserve(pair, "r0")  # the id reused: a fresh reservation, no stale KV
    p = pair.decode.scheduler.pending["r0"]
    assert p.received_tokens == 0 and not p.ranges and not p.complete
    pair.step()
    assert pair.decode.scheduler.pending["r0"].received_tokens == 0
    pair.decode.abort("r0")
    pair.outputs.pop("r0")
    _finish(pair)


def test_held_kv_expires_when_no_reserve_comes(tiny_model):
    pair = PDPair(tiny_model, chunk=64)
    clock = ManualClock(1000.0)
    pair.decode.scheduler.clock = clock
    _add_prefill(pair, "r0")
    _step_until(pair, lambda: _held(pair, "r0") is not None and _held(pair, "r0").complete)
    clock.advance(pair.decode.early.config.ttl_s)  # not yet over
    assert not [e for e in pair.decode.step() if e.kind == EventKind.FAILED]
    clock.advance(0.5)
    failed = [e for e in pair.decode.step() if e.kind == EventKind.FAILED]
    assert [e.leg_id for e in failed] == ["r0"] and "no reservation came" in failed[0].message
    assert pair.decode.early.dropped_legs["expired"] == 1
    assert not _reserve(pair, "r0")  # its KV is gone: a late reserve is refused
    pair.prefill.abort("r0")
    pair.outputs.pop("r0")
    _finish(pair)


@pytest.mark.parametrize("bound", ["leg_chunks", "total_bytes"])
def test_a_bound_hit_drops_the_leg_with_a_clear_error(tiny_model, bound):
    pair = PDPair(tiny_model, chunk=8)  # 40 tokens: 5 chunks of 8
    m = pair.decode.config.model
    chunk_bytes = m.num_layers * 2 * 8 * m.num_kv_heads * m.head_dim * 4  # fp32
    cfg = (EarlyKVConfig(max_leg_chunks=2, max_total_chunks=16) if bound == "leg_chunks"
           else EarlyKVConfig(max_leg_bytes=chunk_bytes, max_total_bytes=chunk_bytes))
    pair.decode.early = EarlyKV(cfg, pair.decode.aborted_early)
    _add_prefill(pair, "r0")
    failed = []
    for _ in range(2000):
        failed += [e for e in pair.prefill.step() + pair.decode.step()
                   if e.kind == EventKind.FAILED and e.leg_id == "r0"]
        if failed:
            break
        pair.receiver.wait(0.01)
    assert "exceed" in failed[0].message and "before its reservation" in failed[0].message \
        or "would exceed the worker's bound" in failed[0].message
    assert pair.decode.early.dropped_legs["limit"] == 1
    _early_empty(pair)
    assert not _reserve(pair, "r0")  # its KV is gone: the reserve is refused
    pair.prefill.abort("r0")
    pair.outputs.pop("r0")
    _finish(pair)


def test_a_held_legs_stream_failing_before_its_reserve_drops_it(tiny_model):
    """The receiver fails a leg whose KV is held (e.g. its link closed mid-stream): the
    held chunks are released, the leg fails with the receiver's reason, its id is closed
    in the receiver, and the reserve that comes later is refused (its KV is gone)."""
    rx = ScriptedReceiver()
    eng = DecodeEngine("decode-0", engine_cfg(tiny_model, 4), DecodeSchedulerConfig(), rx, 16)
    m = eng.config.model
    chunk = KVChunk("r0", 0, 0, 4, torch.zeros(m.num_layers, 2, 4, m.num_kv_heads, m.head_dim))
    rx.script = [ReceiveEvents(chunks=[chunk]),
                 ReceiveEvents(failed=[("r0", "link dropped before final chunk: closed")])]
    assert eng.step() == [] and eng.early.nchunks == 1 and rx.released == []
    [ev] = eng.step()
    assert ev.kind == EventKind.FAILED and "link dropped" in ev.message
    assert rx.released == [chunk] and "r0" in rx.aborted
    assert eng.early.dropped_legs["failed"] == 1 and not eng.early.held
    task = DecodeTask("r0", 4, SamplingParams(max_tokens=2))
    assert not eng.reserve(task)  # refused: its KV is gone
    assert eng.reserve(task)  # the id reused: a fresh reservation, nothing stale
    assert eng.scheduler.pending["r0"].received_tokens == 0
    eng.abort("r0")
    eng.bm.check_integrity()
    assert eng.bm.num_used_blocks == 0 and not eng.has_work and not eng.scheduler.promises
