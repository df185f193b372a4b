"""Prefill fairness and chunk policies, driven step by step with fake clocks (no model)."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, SamplingParams
from prefill_worker.policies import (
    FAIRNESS_POLICIES,
    AdaptivePolicy,
    ChunkPolicy,
    PrefillState,
    TailMergePolicy,
    TenantLedger,
    make_chunk_policy,
    order,
)
from prefill_worker.scheduler import PrefillScheduler, PrefillSchedulerConfig


def st(rid, arrival, remaining, tenant="t", deadline=None, last=None):
    return PrefillState(rid, arrival, remaining, remaining, tenant, deadline, last)


def ids(states):
    return [s.request_id for s in states]


def test_fairness_orders():
    reqs = [st("a", 0.0, 900, deadline=9.0, last=0.5), st("b", 1.0, 10, deadline=3.0),
            st("c", 2.0, 300, tenant="u", deadline=None)]
    now = 2.5
    assert ids(order("fcfs", reqs, now, 100, {})) == ["a", "b", "c"]
    assert ids(order("srpt", reqs, now, 100, {})) == ["b", "c", "a"]
    assert ids(order("round-robin", reqs, now, 100, {})) == ["a", "b", "c"]
    reqs[0].last_served = 2.4  # a was just served: goes to the back
    assert ids(order("round-robin", reqs, now, 100, {})) == ["b", "c", "a"]
    assert ids(order("edf", reqs, now, 100, {})) == ["b", "a", "c"]
    assert ids(order("wfq", reqs, now, 100, {"t": 50.0, "u": 1.0})) == ["c", "a", "b"]


def test_aging_puts_a_starving_request_first_under_every_policy():
    long_wait = st("starved", 0.0, 5000)
    fresh = [st(f"f{i}", 9.0 + i * 0.01, 5) for i in range(3)]
    long_wait.priority = 9  # the priority policy's last choice
    assert len(FAIRNESS_POLICIES) >= 6
    for policy in FAIRNESS_POLICIES:
        assert ids(order(policy, fresh + [long_wait], 10.0, 5.0, {}))[0] == "starved", policy


def test_chunk_policies():
    assert ChunkPolicy(64).size(100, 512) == 64
    assert ChunkPolicy(64).size(100, 20) == 20
    tail = TailMergePolicy(64, min_chunk=16)
    assert tail.size(70, 512) == 70  # a 6-token tail folds into this chunk
    assert tail.size(70, 64) == 64  # ... unless the budget forbids it
    assert tail.size(200, 512) == 64
    ad = AdaptivePolicy(256, min_chunk=32)
    ad.observe_decode_pressure(2.0)
    assert ad.cap == 128
    ad.observe_decode_pressure(0.6)  # between low and high: hold (hysteresis)
    assert ad.cap == 128
    for _ in range(5):
        ad.observe_decode_pressure(5.0)
    assert ad.cap == 32  # never below the minimum
    ad.observe_decode_pressure(0.0)
    assert ad.cap == 64
    with pytest.raises(ValueError, match="chunk_policy"):
        make_chunk_policy("nope", 64)


def _req(rid, n, tenant="t"):
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0), tenant=tenant)


def test_round_robin_interleaves_long_prompts_and_frees_everything():
    bm = BlockManager(64, 16, enable_prefix_caching=False)
    now = [0.0]
    sched = PrefillScheduler(PrefillSchedulerConfig(max_num_batched_tokens=32, max_prefill_chunk=32,
                                                    fairness_policy="round-robin"), bm,
                             clock=lambda: now[0])
    a, b = _req("a", 100), _req("b", 100)
    sched.add(a)
    sched.add(b)
    served = []
    while sched.active or sched.waiting:
        now[0] += 0.01
        items = sched.schedule()
        served += [i.request.request_id for i in items]
        sched.advance(items)
        for i in items:
            if i.completes_prefill:
                sched.finish(i.request, i.request.status)
    assert served[:4] == ["a", "b", "a", "b"]
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_admission_promises_whole_prompts_so_prefills_never_deadlock():
    bm = BlockManager(8, 16, enable_prefix_caching=False)  # 128 tokens of KV
    sched = PrefillScheduler(PrefillSchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=16),
                             bm)
    sched.add(_req("a", 100))  # 7 blocks
    sched.add(_req("b", 100))  # would need 7 more: waits instead of starting
    sched.schedule()
    assert list(sched.active) == ["a"] and len(sched.waiting) == 1
    sched.abort("b")
    sched.abort("a")
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def _drive(sched, max_steps=500, now=None):
    """Run the scheduler to the end like PrefillEngine does; returns the served ids."""
    served = []
    for _ in range(max_steps):
        if not sched.has_work:
            return served
        if now is not None:
            now[0] += 0.001
        items = sched.schedule()
        assert items, "prefills left but none scheduled: deadlock"
        served += [i.request.request_id for i in items]
        sched.advance(items)
        for i in items:
            if i.completes_prefill:
                sched.finish(i.request, i.request.status)
        sched.bm.check_integrity()
    raise AssertionError("prefill scheduler did not drain")


def test_prefix_hit_at_the_queue_head_never_takes_blocks_promised_to_a_running_prefill():
    # 10 blocks of 4 tokens. P leaves 4 hashed blocks in the LRU (and 6 on the free list).
    bm = BlockManager(10, 4)  # prefix caching on, as by default
    sched = PrefillScheduler(PrefillSchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=16),
                             bm)
    p = _req("p", 17)
    sched.add(p)
    _drive(sched)
    assert len(bm._cached_free) == 4 and bm.num_free_blocks == 10
    # A (40 tokens) is promised the whole pool and runs its first chunk from the free list
    a = Request("a", list(range(500, 540)), SamplingParams(temperature=0))
    sched.add(a)
    sched.advance(sched.schedule())
    assert a.num_computed_tokens == 16 and bm.num_free_blocks == 6  # 2 free + 4 cached
    # B shares P's 16-token prefix: taking those 4 cached blocks would leave A's promise
    # of 6 blocks with 2, and A stuck at 16 of 40 tokens forever (prefill never preempts)
    b = Request("b", p.prompt_token_ids[:16] + [900, 901, 902, 903],
                SamplingParams(temperature=0))
    sched.add(b)
    items = sched.schedule()
    assert [(i.request.request_id, i.start) for i in items] == [("a", 16)]
    assert list(sched.active) == ["a"] and not b.block_ids  # B waits holding nothing
    assert sched._promised_blocks() <= bm.num_free_blocks
    sched.advance(items)
    _drive(sched)
    assert a.num_computed_tokens == 40 and b.num_computed_tokens == 20
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def _wfq(now, budget=16):
    bm = BlockManager(64, 16, enable_prefix_caching=False)
    return PrefillScheduler(PrefillSchedulerConfig(max_num_batched_tokens=budget, max_prefill_chunk=16,
                                                   fairness_policy="wfq"), bm, clock=lambda: now[0])


def _serve(sched, now, steps):
    served = []
    for _ in range(steps):
        now[0] += 0.001
        items = sched.schedule()
        served += [i.request.tenant for i in items]
        sched.advance(items)
        for i in items:
            if i.completes_prefill:
                sched.finish(i.request, i.request.status)
    return served


def test_wfq_new_tenant_starts_at_the_virtual_time_instead_of_going_first_until_it_catches_up():
    now = [0.0]
    sched = _wfq(now)
    sched.add(_req("old-1", 300, tenant="old"))
    assert _serve(sched, now, 5) == ["old"] * 5  # 80 tokens served alone
    sched.add(_req("new-1", 300, tenant="renamed"))  # a new (or renamed) tenant arrives
    # it is served like the least-served running tenant: turns alternate from now on
    assert _serve(sched, now, 6) == ["old", "renamed"] * 3
    for rid in ("old-1", "new-1"):
        sched.abort(rid)
    assert len(sched.served) == 0 and sched.bm.num_used_blocks == 0


def test_tenant_ledger_virtual_time_floor_and_weights():
    led = TenantLedger({"gold": 2.0})
    led.join("a")
    led.activate("a")
    led.charge("a", 100)
    led.tick(["a"])
    assert led.vtime == 100.0
    led.join("gold")  # arrives while a runs: starts at the virtual time, not at 0
    led.activate("gold")
    assert led["gold"] == 100.0
    led.charge("gold", 100)  # weight 2: half the virtual cost
    led.charge("a", 100)
    led.tick(["a", "gold"])
    assert (led["a"], led["gold"], led.vtime) == (200.0, 150.0, 150.0)
    led.activate("a")  # a was ahead: activation never lowers it
    assert led["a"] == 200.0
    led.leave("gold")
    assert "gold" not in led and len(led) == 1
    led.leave("a")
    assert len(led) == 0 and led.vtime == 0.0


def test_tenant_ledger_holds_only_tenants_with_live_requests():
    now = [0.0]
    sched = _wfq(now, budget=64)
    for i in range(1000):  # tenant strings come from clients: every one different
        sched.add(_req(f"r{i}", 8, tenant=f"client-{i}"))
        if i % 3 == 0:
            sched.abort(f"r{i}")
        assert len(sched.served) <= len(sched.waiting) + len(sched.active)
    while sched.has_work:
        _serve(sched, now, 1)
        assert len(sched.served) <= len(sched.waiting) + len(sched.active)
    assert len(sched.served) == 0
    sched.bm.check_integrity()
    assert sched.bm.num_used_blocks == 0


def _priority_sched(now, aging_s=5.0):
    bm = BlockManager(64, 16, enable_prefix_caching=False)
    return PrefillScheduler(PrefillSchedulerConfig(
        max_num_batched_tokens=16, max_prefill_chunk=16, fairness_policy="priority",
        aging_s=aging_s), bm, clock=lambda: now[0])


def test_priority_policy_serves_lower_values_first_then_arrival_order():
    now = [0.0]
    sched = _priority_sched(now)
    for rid, priority in (("bulk", 5), ("urgent", -1), ("mid-1", 1), ("mid-2", 1)):
        now[0] += 0.001
        sched.add(_req(rid, 32), priority=priority)  # two chunks each, one chunk per step
    served = _drive(sched, now=now)
    assert served == ["urgent"] * 2 + ["mid-1"] * 2 + ["mid-2"] * 2 + ["bulk"] * 2
    assert sched.bm.num_used_blocks == 0
    # fcfs ignores priority altogether
    now = [0.0]
    fcfs = PrefillScheduler(PrefillSchedulerConfig(max_num_batched_tokens=16,
                                                   max_prefill_chunk=16),
                            BlockManager(64, 16), clock=lambda: now[0])
    fcfs.add(_req("first", 16), priority=9)
    fcfs.add(_req("second", 16), priority=0)
    assert _drive(fcfs, now=now) == ["first", "second"]


def test_priority_policy_ages_a_low_priority_request_ahead_so_it_never_starves():
    now = [0.0]
    sched = _priority_sched(now, aging_s=0.05)
    sched.add(_req("low", 16), priority=10)
    served, step = [], 0
    while "low" not in served:
        step += 1
        sched.add(_req(f"hi-{step}", 16), priority=0)  # an endless stream of urgent work
        now[0] += 0.001
        items = sched.schedule()
        served += [i.request.request_id for i in items]
        sched.advance(items)
        for i in items:
            sched.finish(i.request, i.request.status)
        assert step < 1000, "the low-priority request starved"
    # served exactly when it had waited aging_s (50 steps of 1 ms), not before
    assert served[-1] == "low" and 49 <= len(served) - 1 <= 51
    assert all(rid.startswith("hi-") for rid in served[:-1])
    for rid in list(sched.active) + [r.request_id for r, _ in sched.waiting]:
        sched.abort(rid)
    sched.bm.check_integrity()
    assert sched.bm.num_used_blocks == 0
