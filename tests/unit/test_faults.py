"""Fault injection without Ray: the plan, seeded triggers, each KV frame fault through a
real sender/receiver pair (inproc and tcp), and the engine-level outcomes of a fault
(KV never completes -> kv_wait_timeout -> EventKind.FAILED; corrupt -> checksum -> EventKind.FAILED on both
sides; refused admission), each ending in a leak check."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from decode_worker.scheduler import DecodeSchedulerConfig
from engine.config import EngineConfig
from engine.loader import load_model_config
from kv_transfer import KVChunk, TransferConfig, make_receiver, make_sender
from kv_transfer.faults import ENV_VAR, FaultInjector, FaultPlan, FaultSpec
from kv_transfer.testing import PagedKV, make_chunks, pump
from runtime.messages import DecodeTask, EventKind, PrefillTask
from runtime.spec import WorkerSpec, fault_plan, worker_fault_injector
from tests.pd_harness import PDPair, greedy

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
SECRET = b"fault-injection-tests-secret-0123456789"


# ---- the plan and its triggers --------------------------------------------------------
def test_plan_parses_every_accepted_form_and_rejects_bad_ones():
    one = {"kind": "drop", "request_filter": "^a"}
    assert FaultPlan.parse(None) == FaultPlan.parse("") == FaultPlan()
    assert FaultPlan.parse(one).faults == (FaultSpec("drop", request_filter="^a"),)
    assert FaultPlan.parse([one, {"kind": "delay", "delay_s": 0.1}]).faults[1].delay_s == 0.1
    plan = FaultPlan.parse('{"seed": 3, "faults": [{"kind": "corrupt", "every_nth": 2}]}')
    assert plan.seed == 3 and plan.faults[0].every_nth == 2
    assert FaultPlan.parse(plan.to_dict()) == plan
    for bad, words in [({"kind": "explode"}, "kind"), ({"kind": "drop", "every_nth": 0}, "every_nth"),
                       ({"kind": "drop", "probability": 2}, "probability"),
                       ({"kind": "drop", "request_filter": "("}, "regex"),
                       ({"kind": "drop", "colour": 1}, "unknown fault field"),
                       ("{not json", "JSON"), ({"seed": 1, "extra": []}, "fault plan")]:
        with pytest.raises(ValueError, match=words):
            FaultPlan.parse(bad)


def test_triggers_are_seeded_filtered_counted_and_capped():
    plan = FaultPlan.parse({"seed": 5, "faults": [
        {"kind": "drop", "every_nth": 3, "max_count": 2, "request_filter": "#1$"},
        {"kind": "delay", "probability": 0.5},
        {"kind": "refuse_admission", "worker_filter": "^decode-0$"}]})

    def run(worker: str) -> list[list[str]]:
        inj = FaultInjector(plan, worker)
        return [[f.kind for f in inj.decide(("drop", "delay"), f"r{i % 2}#{1 + i % 2}")]
                for i in range(40)]

    a, b = run("prefill-0"), run("prefill-0")
    assert a == b  # seeded: the same events get the same faults
    drops = [i for i, kinds in enumerate(a) if "drop" in kinds]
    # only "#1" legs (even i) match; the 3rd and 6th matching events fire, then the cap
    assert drops == [4, 10]
    delays = sum("delay" in k for k in a)
    assert 8 < delays < 32
    assert FaultInjector(plan, "decode-0").refuse_admission("x")
    assert not FaultInjector(plan, "decode-1").refuse_admission("x")
    assert FaultInjector(plan, "decode-1").plan.faults[0].kind == "drop"


def test_worker_plan_comes_from_the_spec_and_the_environment(tiny_model):
    engine = EngineConfig(str(tiny_model), load_model_config(tiny_model))
    spec = WorkerSpec("decode-0", "decode", engine, DecodeSchedulerConfig(), TransferConfig())
    assert worker_fault_injector(spec, environ={}) is None  # production: nothing at all
    env = {ENV_VAR: '{"faults": [{"kind": "refuse_admission"}]}'}
    inj = worker_fault_injector(spec, environ=env)
    assert inj is not None and inj.refuse_admission("r") and inj.stats() == {
        "fault_refuse_admission": 1}
    both = dataclasses.replace(spec, faults=FaultPlan.parse({"faults": [{"kind": "drop"}]}))
    assert [f.kind for f in fault_plan(both.faults, env).faults] == [
        "drop", "refuse_admission"]
    only_other = dataclasses.replace(spec, faults=FaultPlan.parse({
        "faults": [{"kind": "drop", "worker_filter": "prefill"}]}))
    assert worker_fault_injector(only_other, environ={}) is None


# ---- KV frame faults through a real sender and receiver -------------------------------
def _transfer(plan: dict, connector: str = "inproc", n_requests: int = 3, **cfg_kw):
    """Send `n_requests` requests of 4 chunks each through a faulty sender; returns
    (sender failures, receiver failures, receiver completed ids, caches, sender, receiver)."""
    kw = {"secret": SECRET} if connector == "tcp" else {}
    cfg = TransferConfig(connector=connector, **kw, **cfg_kw)
    rx, tx = make_receiver(cfg), make_sender(cfg)
    inj = FaultInjector(FaultPlan.parse(plan), "prefill-0")
    tx.wrap_transports(inj.wrap_transport)
    src = PagedKV(**SHAPE, block_size=16, num_blocks=64)
    dst = PagedKV(**SHAPE, block_size=8, num_blocks=128)
    rids = [f"r{i}#1" for i in range(n_requests)]
    for i, rid in enumerate(rids):
        for cache in (src, dst):
            cache.allocate(rid, 50)
        src.fill_random(rid, 50, seed=i)
        for c in make_chunks(src, rid, [0, 13, 29, 40, 50]):
            tx.send(c, dest=rx.endpoint)
    completed: set[str] = set()
    orig_poll = rx.poll

    def poll():
        ev = orig_poll()
        completed.update(ev.completed)
        return ev

    rx.poll = poll
    tx_failed, rx_failed = pump(tx, rx, dst, rids, timeout_s=30)
    return tx_failed, rx_failed, completed, (src, dst), tx, rx, inj


def _exact(caches, rid: str) -> bool:
    src, dst = caches
    return torch.equal(src.export(rid, 0, 50), dst.export(rid, 0, 50))


def _no_leftovers(tx, rx) -> None:
    s, r = tx.stats(), rx.stats()
    assert s["inflight_bytes"] == 0 and s["queued_bytes"] == 0 and s["active_requests"] == 0
    assert r["active_requests"] == 0 and r["inbox_chunks"] == 0 and r["inflight_bytes"] == 0


def _wire_quiet(tx, rx, dst: PagedKV) -> None:
    """Return once every frame already written on the link has reached the receiver.

    A sender reports a request finished when the receiver released its frames, which
    can come before a duplicated frame's second copy is even written. Frames of one link
    arrive in order, so once a fault-free sentinel sent now has arrived, so has every
    copy written before it."""
    dst.allocate("sentinel", 1)
    tx.send(KVChunk("sentinel", 0, 0, 1, torch.zeros(SHAPE["num_layers"], 2, 1,
                                                     SHAPE["num_kv_heads"], SHAPE["head_dim"]),
                    is_final=True, first_token=1), dest=rx.endpoint)
    assert pump(tx, rx, dst, ["sentinel"], timeout_s=30) == ({}, {})


@pytest.mark.parametrize("connector", ["inproc", "torchdist"])
@pytest.mark.parametrize("kind", ["duplicate", "reorder", "delay"])
def test_duplicate_reorder_and_delay_deliver_byte_exact_kv(kind, connector):
    tx_f, rx_f, done, caches, tx, rx, inj = _transfer(
        {"kind": kind, "delay_s": 0.01, "request_filter": "^r"}, connector)
    try:
        assert (tx_f, rx_f) == ({}, {}) and done == {"r0#1", "r1#1", "r2#1"}
        assert all(_exact(caches, f"r{i}#1") for i in range(3))
        assert inj.stats()[f"fault_{kind}"] >= 6
        if kind == "duplicate":
            _wire_quiet(tx, rx, caches[1])
            assert rx.stats()["duplicates"] == inj.stats()["fault_duplicate"]
        _no_leftovers(tx, rx)
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("connector", ["inproc", "torchdist"])
def test_corrupt_frame_is_caught_by_the_checksum_and_fails_the_request_on_both_sides(connector):
    plan = {"kind": "corrupt", "request_filter": "^r1#", "every_nth": 2, "max_count": 1}
    tx_f, rx_f, done, caches, tx, rx, inj = _transfer(plan, connector)
    try:
        assert set(tx_f) == {"r1#1"} and set(rx_f) == {"r1#1"}
        assert "checksum mismatch" in rx_f["r1#1"] and "rejected" in tx_f["r1#1"]
        assert done == {"r0#1", "r2#1"} and _exact(caches, "r0#1") and _exact(caches, "r2#1")
        assert rx.stats()["checksum_failures"] == 1 and inj.stats() == {"fault_corrupt": 1}
        _no_leftovers(tx, rx)
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("connector", ["inproc", "torchdist"])
def test_dropped_frame_leaves_the_request_incomplete_until_the_owner_aborts_it(connector):
    tx_f, rx_f, done, caches, tx, rx, inj = _transfer(
        {"kind": "drop", "request_filter": "^r0#", "every_nth": 3, "max_count": 1}, connector)
    try:
        # the sender believes everything arrived; the receiver never completes r0
        assert (tx_f, rx_f) == ({}, {}) and done == {"r1#1", "r2#1"}
        assert rx.stats()["active_requests"] == 1
        rx.abort("r0#1")  # what the decode worker does on kv_wait_timeout
        _no_leftovers(tx, rx)
    finally:
        tx.close()
        rx.close()


def test_tcp_stall_longer_than_failure_timeout_fails_the_link_shorter_is_only_slow():
    slow = {"kind": "stall", "stall_s": 0.3, "every_nth": 2, "max_count": 1}
    tx_f, rx_f, done, caches, tx, rx, _ = _transfer(slow, "tcp", failure_timeout_s=2.0)
    try:
        assert (tx_f, rx_f) == ({}, {}) and all(_exact(caches, f"r{i}#1") for i in range(3))
    finally:
        tx.close()
        rx.close()
    dead = {"kind": "stall", "stall_s": 5.0, "every_nth": 2, "max_count": 1}
    tx_f, rx_f, done, caches, tx, rx, _ = _transfer(dead, "tcp", n_requests=1,
                                                    failure_timeout_s=0.6)
    try:
        assert set(tx_f) == {"r0#1"} and not done
    finally:
        tx.close()
        rx.close()


# ---- engine-level outcomes (prefill + decode engines over inproc) ---------------------
def _pair(tiny_model, plan: dict | None = None) -> tuple[PDPair, FaultInjector | None]:
    pair = PDPair(tiny_model, chunk=8)
    inj = None
    if plan is not None:
        inj = FaultInjector(FaultPlan.parse(plan), "prefill-0")
        pair.sender.wrap_transports(inj.wrap_transport)
    return pair, inj


def _set_kv_wait_timeout(pair: PDPair, seconds: float) -> None:
    sched = pair.decode.scheduler
    sched.config = dataclasses.replace(sched.config, kv_wait_timeout_s=seconds)


def _run(pair: PDPair, rids: tuple[str, ...] | None = None, timeout_s: float = 120.0) -> None:
    """Step until `rids` (default: all, with both engines idle) ended; wall-clock
    bounded, since a lost frame is only noticed when kv_wait_timeout_s has passed."""
    end = time.monotonic() + timeout_s
    while not (all(r in pair.finished for r in rids) if rids else (
            all(r in pair.finished for r in pair.outputs) and not pair.prefill.has_work
            and not pair.decode.has_work)):
        assert time.monotonic() < end, f"P/D pair did not finish: {pair.finished}"
        pair.step()
        time.sleep(0.001)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, 2000) for _ in range(20 + 7 * i)] for i in range(n)]


@pytest.mark.parametrize("kind", ["drop", "corrupt"])
def test_lost_or_corrupt_kv_fails_only_that_request_and_leaks_nothing(tiny_model, kind):
    pair, inj = _pair(tiny_model, {"kind": kind, "request_filter": "^bad$", "every_nth": 2})
    clean, _ = _pair(tiny_model)
    ps = _prompts(3)
    for rid, p in zip(("ok0", "bad", "ok1"), ps, strict=True):
        assert pair.submit(rid, p, greedy(6)) and clean.submit(rid, p, greedy(6))
    _run(clean)
    _run(pair, ("ok0", "ok1"))  # the healthy requests finish whatever happens to "bad"
    # the decode side notices lost KV only after kv_wait_timeout_s (default 60 s)
    _set_kv_wait_timeout(pair, 0.05)
    _run(pair)
    assert pair.finished["bad"] == EventKind.FAILED
    failed = [ev for ev in pair.events if ev.kind == EventKind.FAILED]
    reason = "timed out waiting for KV" if kind == "drop" else "checksum mismatch"
    assert any(reason in ev.message for ev in failed), failed
    # the failed request's decode side is gone; its prefill side ended too
    pair.prefill.abort("bad")
    for rid in ("ok0", "ok1"):
        assert pair.outputs[rid] == clean.outputs[rid] and pair.finished[rid] == "length"
    assert inj.stats()[f"fault_{kind}"] >= 1
    pair.leak_check()
    clean.leak_check()
    pair.close()
    clean.close()


def test_refused_admission_reserves_nothing(tiny_model):
    pair, _ = _pair(tiny_model)
    pair.decode.faults = FaultInjector(FaultPlan.parse(
        {"kind": "refuse_admission", "request_filter": "^no-", "max_count": 2}), "decode-0")
    eos = pair.prefill.config.model.eos_token_ids
    task = DecodeTask("no-1", 10, greedy(4), eos)
    assert not pair.decode.reserve(task) and not pair.decode.reserve(task)
    assert pair.decode.reserve(task)  # max_count reached: admitted now
    pair.prefill.add(PrefillTask("no-1", tuple(range(1, 11)), greedy(4),
                                 pair.receiver.endpoint, eos))
    pair.outputs["no-1"] = []
    _run(pair)
    assert pair.finished["no-1"] == "length" and len(pair.outputs["no-1"]) == 4
    assert pair.decode.faults.stats() == {"fault_refuse_admission": 2}
    pair.leak_check()
    pair.close()


# ---- service bugs the soak found (deterministic repros, now fixed) ---------------------
def test_a_one_token_final_chunk_is_sampled_with_its_own_params(tiny_model):
    from engine import LLM, SamplingParams

    want = LLM(str(tiny_model)).generate([[9], [11]], greedy(3))
    for trial, prompt in enumerate(([9], [11])):
        pair = PDPair(tiny_model, chunk=64, budget=256)
        # a hot sampled request completes its prompt in the same step, listed first
        pair.submit("hot", list(range(100, 140)),
                    SamplingParams(temperature=5.0, max_tokens=3, seed=trial))
        pair.submit("cold", prompt, greedy(3))  # a 1-token chunk: run as a decode row
        _run(pair)
        assert pair.outputs["cold"] == want[trial].token_ids
        pair.leak_check()
        pair.close()


def test_an_abort_that_overtakes_its_add_leaves_no_orphan_prefill_job(tiny_model):
    pair, _ = _pair(tiny_model)
    pair.prefill.abort("late")  # the router's abort, run first
    eos = pair.prefill.config.model.eos_token_ids
    try:
        pair.prefill.add(PrefillTask("late", tuple(range(1, 30)), greedy(4),
                                     pair.receiver.endpoint, eos))
    except ValueError:
        pass  # refusing the late add is a fine fix too
    end = time.monotonic() + 30
    while pair.prefill.scheduler.has_work and time.monotonic() < end:
        pair.prefill.step()  # the router ignores the events of a leg it ended
    for _ in range(200):  # then let the sender report
        pair.prefill.step()
        time.sleep(0.005)
    assert not pair.prefill.jobs and not pair.prefill.has_work
    pair.close()


def test_an_abort_that_overtakes_its_reserve_leaves_no_promise(tiny_model):
    pair, _ = _pair(tiny_model)
    eos = pair.decode.config.model.eos_token_ids
    free = pair.decode.headroom_blocks()
    assert pair.decode.abort("late") is False  # the router's abort of a cancelled client
    assert pair.decode.reserve(DecodeTask("late", 29, greedy(4), eos)) is False
    assert pair.decode.headroom_blocks() == free
    # the id is not refused forever: only that one overtaken reserve was dropped
    assert pair.decode.reserve(DecodeTask("late", 29, greedy(4), eos)) is True
    assert pair.decode.abort("late") is True
    pair.leak_check()
    pair.close()
