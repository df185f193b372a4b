"""Request ids on one worker (docs/design.md §5): once a leg ends here with any status its id is
free again at once. An abort that arrives after the end (the router ends every leg it
opened) is late and leaves nothing behind; only an abort that overtakes its own
add/reserve leaves a tombstone, which swallows exactly that add/reserve."""

from __future__ import annotations

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.scheduler import DecodeSchedulerConfig
from engine.tombstones import Tombstones
from kv_transfer.base import KVChunk, ReceiveEvents
from prefill_worker.engine import PrefillEngine
from prefill_worker.scheduler import PrefillSchedulerConfig
from runtime.messages import DecodeTask, EventKind, PrefillTask
from tests.engine_fakes import RecordingSender, ScriptedReceiver
from tests.pd_harness import engine_cfg, greedy

PROMPT = tuple(range(1, 11))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_tombstones_only_bury_ids_that_did_not_end_here():
    t = Tombstones()
    t.ended("done")
    assert not t.bury("done") and not t.bury("done")  # late, even repeated
    assert not t.claim("done")  # the id is free: a new add starts
    assert t.bury("early") and t.claim("early") and not t.claim("early")  # exactly one
    assert len(t) == 0


# ---- prefill worker ------------------------------------------------------------------
def _prefill(tiny_model):
    sender = RecordingSender()
    eng = PrefillEngine("prefill-0", engine_cfg(tiny_model, 4),
                        PrefillSchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=64),
                        sender, 32)
    return eng, sender


def _task(eng, rid, max_tokens=4):
    return PrefillTask(rid, PROMPT, greedy(max_tokens), "scripted://decode",
                       eng.config.model.eos_token_ids)


def _prefill_until(eng, kind, rid, max_steps=50):
    for _ in range(max_steps):
        for ev in eng.step():
            if ev.kind == kind and ev.leg_id == rid:
                return ev
    raise AssertionError(f"no {kind} event for {rid}")


def _prefill_leak_check(eng):
    eng.bm.check_integrity()
    assert not eng.jobs and not eng.has_work and eng.bm.num_used_blocks == 0
    assert len(eng.scheduler.served) == 0


@pytest.mark.parametrize("end", ["delivered", "send_failed", "finished_at_first_token"])
def test_prefill_abort_after_the_leg_ended_leaves_no_tombstone_and_the_id_runs_again(
        tiny_model, end):
    eng, sender = _prefill(tiny_model)
    eng.add(_task(eng, "x", max_tokens=1 if end == "finished_at_first_token" else 4))
    first = _prefill_until(eng, EventKind.FIRST_TOKEN, "x")
    if end == "delivered":
        sender.events.finished.append("x")
        _prefill_until(eng, EventKind.PREFILL_DONE, "x")
    elif end == "send_failed":
        sender.events.failed.append(("x", "link dropped"))
        _prefill_until(eng, EventKind.FAILED, "x")
    else:
        assert first.finish_reason == "length"
    assert not eng.jobs
    assert eng.abort("x") is False and eng.abort("x") is False  # late, even twice
    eng.add(_task(eng, "x"))  # the id is free again: a new request, not swallowed
    assert "x" in eng.jobs
    _prefill_until(eng, EventKind.FIRST_TOKEN, "x")
    sender.events.finished.append("x")
    _prefill_until(eng, EventKind.PREFILL_DONE, "x")
    _prefill_leak_check(eng)


def test_prefill_abort_that_overtakes_its_add_swallows_exactly_that_add(tiny_model):
    eng, sender = _prefill(tiny_model)
    assert eng.abort("y") is False  # run before its add (threaded actor)
    eng.add(_task(eng, "y"))
    assert "y" not in eng.jobs and not eng.has_work
    eng.add(_task(eng, "y"))  # a later add of the id is a new request
    _prefill_until(eng, EventKind.FIRST_TOKEN, "y")
    assert eng.abort("y") is True  # mid-transfer: ends it
    assert eng.abort("y") is False
    eng.add(_task(eng, "y"))
    assert "y" in eng.jobs
    eng.abort("y")
    _prefill_leak_check(eng)


def test_prefill_rejects_a_prompt_that_can_never_fit_its_pool(tiny_model):
    eng, _ = _prefill(tiny_model)  # 32 blocks of 4 tokens
    too_long = PrefillTask("z", tuple(range(1, 200)), greedy(2), "scripted://decode")
    with pytest.raises(ValueError, match="cannot fit this prefill worker's KV cache"):
        eng.add(too_long)
    _prefill_leak_check(eng)



@pytest.mark.parametrize("prompt, message", [
    ((), "prompt is empty"),
    ((1, -1, 2), "prompt token id -1 is outside the vocabulary"),
    ((1, 10**6), "prompt token id 1000000 is outside the vocabulary"),
    (tuple(range(1, 1025)), "max_model_len is 1024"),
])
def test_prefill_refuses_a_bad_prompt_that_reaches_it_without_a_front_door(
        tiny_model, prompt, message):
    """The front door validates; a task sent to the worker directly is still refused,
    with the problem named, and leaves nothing behind."""
    eng, _ = _prefill(tiny_model)
    with pytest.raises(ValueError, match=message):
        eng.add(PrefillTask("bad", prompt, greedy(2), "scripted://decode"))
    _prefill_leak_check(eng)

# ---- decode worker -------------------------------------------------------------------
def _decode(tiny_model, num_blocks=16):
    rx = ScriptedReceiver()
    eng = DecodeEngine("decode-0", engine_cfg(tiny_model, 4),
                       DecodeSchedulerConfig(max_model_len=1024, headroom_tokens=0), rx,
                       num_blocks)
    return eng, rx


def _kv(eng, rid, n, first=5):
    m = eng.config.model
    payload = torch.zeros(m.num_layers, 2, n, m.num_kv_heads, m.head_dim)
    return ReceiveEvents(chunks=[KVChunk(rid, 0, 0, n, payload, is_final=True,
                                         first_token=first)], completed=[rid])


def _decode_until_end(eng, rid, max_steps=50):
    for _ in range(max_steps):
        for ev in eng.step():
            if ev.leg_id == rid and (ev.kind in (EventKind.FAILED, EventKind.PREEMPTED) or (
                    ev.kind == EventKind.TOKENS and ev.finish_reason)):
                return ev
    raise AssertionError(f"{rid} did not end")


def _decode_leak_check(eng):
    eng.bm.check_integrity()
    assert not eng.has_work and eng.bm.num_used_blocks == 0 and not eng.scheduler.promises


@pytest.mark.parametrize("end", ["finished", "failed", "preempted"])
def test_decode_abort_after_the_request_ended_leaves_no_tombstone_and_the_id_is_free(
        tiny_model, end):
    eng, rx = _decode(tiny_model, num_blocks=3)  # 12 tokens of KV
    n = 8
    assert eng.reserve(DecodeTask("x", n, greedy(2 if end == "finished" else 30)))
    if end == "failed":
        rx.script.append(ReceiveEvents(failed=[("x", "link dropped")]))
    else:
        rx.script.append(_kv(eng, "x", n))
    if end == "preempted":  # b takes the last block's promise: x cannot grow past 12
        assert eng.reserve(DecodeTask("b", 4, greedy(2)))
    ev = _decode_until_end(eng, "x")
    assert ev.kind == {"finished": EventKind.TOKENS, "failed": EventKind.FAILED, "preempted": EventKind.PREEMPTED}[end]
    assert eng.abort("x") is False and eng.abort("x") is False  # late, even twice
    eng.abort("b")
    assert eng.reserve(DecodeTask("x", n, greedy(2)))  # free again: not swallowed
    rx.script.append(_kv(eng, "x", n))
    assert _decode_until_end(eng, "x").finish_reason == "length"
    _decode_leak_check(eng)


def test_decode_abort_that_overtakes_its_reserve_swallows_exactly_that_reserve(tiny_model):
    eng, rx = _decode(tiny_model)
    assert eng.abort("y") is False
    assert eng.reserve(DecodeTask("y", 4, greedy(2))) is False
    assert eng.headroom_blocks() == eng.bm.num_blocks
    assert eng.reserve(DecodeTask("y", 4, greedy(2))) is True
    assert eng.abort("y") is True
    _decode_leak_check(eng)
