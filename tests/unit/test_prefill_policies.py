"""Prefill fairness and chunk policies, driven step by step with fake clocks (no model)."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, SamplingParams
from prefill_worker.policies import (
    AdaptivePolicy,
    ChunkPolicy,
    PrefillState,
    TailMergePolicy,
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
    for policy in ("fcfs", "srpt", "round-robin", "wfq", "edf"):
        assert ids(order(policy, fresh + [long_wait], 10.0, 5.0, {}))[0] == "starved"


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
    sched = PrefillScheduler(PrefillSchedulerConfig(max_num_batched_tokens=32, max_chunk=32,
                                                    fairness="round-robin"), bm,
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
    sched = PrefillScheduler(PrefillSchedulerConfig(max_num_batched_tokens=16, max_chunk=16),
                             bm)
    sched.add(_req("a", 100))  # 7 blocks
    sched.add(_req("b", 100))  # would need 7 more: waits instead of starting
    sched.schedule()
    assert list(sched.active) == ["a"] and len(sched.waiting) == 1
    sched.abort("b")
    sched.abort("a")
    bm.check_integrity()
    assert bm.num_used_blocks == 0
