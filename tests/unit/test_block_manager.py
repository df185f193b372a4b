"""BlockManager lifecycles driven step by step through the scheduler with fake runner
outputs: abort in every state, preemption by recompute, allocation contracts and any
sequence of events (prefix caching: test_block_manager_prefix.py). Every test ends with a
leak check (integrity holds, zero used blocks)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus, SamplingParams
from tests.sched_steps import FAKE_TOKEN, assert_no_leak, make, run_to_end, sched, step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- abort in every state -----------------------------------------------------------
def test_abort_while_waiting_frees_nothing_and_finishes_aborted():
    s = sched(8)
    r = make("a", 10)
    s.add_request(r)
    assert s.abort("a") is r
    assert r.status == RequestStatus.FINISHED_ABORTED and r.is_finished
    assert r.finish_reason.value == "abort"
    assert s.abort("a") is None  # unknown now
    assert_no_leak(s)


def test_abort_while_prefilling_frees_the_partial_prefill_blocks():
    s = sched(16, max_num_batched_tokens=6)
    r = make("a", 20)
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.PREFILLING
    assert r.num_computed_tokens == 6 and len(r.block_ids) == 2
    assert s.bm.num_used_blocks == 2
    s.abort("a")
    assert r.status == RequestStatus.FINISHED_ABORTED and not r.block_ids
    assert_no_leak(s)


def test_abort_while_running_frees_prompt_and_decode_blocks():
    s = sched(16, max_num_batched_tokens=64)
    r = make("a", 7, max_tokens=10)
    s.add_request(r)
    for _ in range(4):  # prefill + 3 decodes: 7 + 3 tokens of KV -> 3 blocks
        step(s)
    assert r.status == RequestStatus.RUNNING and r.num_cached_tokens == 10
    assert s.bm.num_used_blocks == 3
    s.abort("a")
    assert_no_leak(s)


def test_abort_between_schedule_and_update_drops_the_step_result():
    s = sched(16, max_num_batched_tokens=64)
    a, b = make("a", 5), make("b", 5, base=300)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.abort("a")  # e.g. a client cancel while the step runs
    touched = s.update(out, {"a": 1, "b": 2})
    assert touched == [b] and a.output_token_ids == [] and b.output_token_ids == [2]
    run_to_end(s)
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert_no_leak(s)


def test_abort_of_a_preempted_request_waiting_for_recompute():
    s = sched(4, max_num_batched_tokens=64, prefix=False)
    a, b = make("a", 4, max_tokens=8), make("b", 4, max_tokens=8, base=300)
    s.add_request(a)
    s.add_request(b)
    while b.status != RequestStatus.PREEMPTED:
        step(s)
    assert s.waiting[0] is b and not b.block_ids
    s.abort("b")
    run_to_end(s)
    assert a.status == RequestStatus.FINISHED_LENGTH and len(a.output_token_ids) == 8
    assert_no_leak(s)


# ---- preemption by recompute --------------------------------------------------------
def test_preemption_by_recompute_when_blocks_run_out_then_both_finish():
    # 6 blocks of 4: two 8-token prompts take 4; decodes grow both until the pool is dry
    s = sched(6, max_num_batched_tokens=64, prefix=False)
    a, b = make("a", 8, max_tokens=8), make("b", 8, max_tokens=8, base=300)
    s.add_request(a)
    s.add_request(b)
    preempted_at = None
    for n in range(100):
        out = step(s)
        if out.preempted:
            assert out.preempted == [b]  # the newest request is the victim
            preempted_at = n
            # recompute: no KV, back at the head of the queue, prefill covers every token
            assert b.status == RequestStatus.PREEMPTED and s.waiting[0] is b
            assert b.num_computed_tokens == b.num_cached_tokens == 0 and not b.block_ids
            assert b.prefill_len == b.num_tokens == 8 + len(b.output_token_ids)
            assert b.num_preemptions == 1
            assert [i.request for i in out.items] == [a]
        if not s.has_unfinished:
            break
    assert preempted_at is not None
    for r in (a, b):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [FAKE_TOKEN] * 8
    assert_no_leak(s)


def test_partial_prefills_that_cannot_grow_preempt_the_newest():
    # two long prompts admitted chunk by chunk exhaust the pool before either completes
    s = sched(6, max_num_batched_tokens=8, max_prefill_chunk=4, prefix=False)
    a, b = make("a", 20, max_tokens=2), make("b", 20, max_tokens=2, base=300)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    for _ in range(100):
        preempted += step(s).preempted
        if not s.has_unfinished:
            break
    assert b in preempted
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert_no_leak(s)


def test_preempted_request_recomputes_to_the_same_greedy_tokens(tiny_model):
    from engine import LLM

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(10 + 3 * i, 26 + 3 * i)) for i in range(4)]
    roomy = LLM(str(tiny_model), block_size=4)
    want = [o.token_ids for o in roomy.generate(prompts, sp)]
    # 4 requests x ceil(28 / 4) = 28 blocks of demand against 12 blocks
    tight = LLM(str(tiny_model), block_size=4, num_blocks=12, enable_prefix_caching=False)
    reqs = [tight.add_request(p, sp) for p in prompts]
    while tight.has_unfinished():
        tight.step()
        tight.block_manager.check_integrity()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert [r.output_token_ids for r in reqs] == want
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    tight.block_manager.check_integrity()
    assert tight.block_manager.num_used_blocks == 0


def test_request_larger_than_the_pool_is_rejected_not_stuck(tiny_model):
    from engine import LLM

    llm = LLM(str(tiny_model), block_size=4, num_blocks=4)  # room for 16 tokens
    assert llm.config.scheduler.max_model_len == 16
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request(list(range(1, 21)))
    # a request that would outgrow the pool stops at the capacity instead of looping
    out = llm.generate([list(range(1, 10))],
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert out.finish_reason.value == "length" and len(out.token_ids) == 16 - 9
    with pytest.raises(ValueError, match="KV cache"):
        LLM(str(tiny_model), block_size=4, num_blocks=4, max_model_len=64)
    llm.block_manager.check_integrity()
    assert llm.block_manager.num_used_blocks == 0


# ---- BlockManager contracts ---------------------------------------------------------
def test_allocate_is_all_or_nothing():
    bm = BlockManager(3, 4)
    r = make("a", 1)
    assert bm.allocate(r, 8) and len(r.block_ids) == 2
    assert not bm.allocate(r, 16)  # needs 2 more, 1 free: nothing taken
    assert len(r.block_ids) == 2 and bm.num_free_blocks == 1
    assert bm.blocks_needed(r, 12) == 1
    bm.free(r)
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and not r.block_ids


def test_check_integrity_catches_a_leaked_reference():
    bm = BlockManager(4, 4)
    r = make("a", 4)
    bm.allocate(r, 4)
    bm._ref[r.block_ids[0]] += 1  # simulate a bug
    with pytest.raises(AssertionError):
        bm.check_integrity()
    bm._ref[r.block_ids[0]] -= 1
    bm.free(r)
    bm.check_integrity()
    assert bm.num_used_blocks == 0


# ---- any sequence of events ---------------------------------------------------------
events = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
        st.integers(1, 30),  # prompt length / abort pick
        st.integers(1, 6),  # max_tokens
        st.integers(0, 2),  # shared prefix family
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events, num_blocks=st.integers(8, 24), block_size=st.sampled_from([1, 4, 5]),
       budget=st.integers(1, 24), chunked=st.booleans(), prefix=st.booleans())
def test_any_event_sequence_keeps_integrity_and_drains_without_leaks(
    events, num_blocks, block_size, budget, chunked, prefix
):
    max_len = num_blocks * block_size
    s = sched(num_blocks, block_size, prefix, max_num_batched_tokens=budget,
              enable_chunked_prefill=chunked, max_num_seqs=4, max_model_len=max_len)
    live: list[Request] = []
    for n, (kind, length, max_tokens, family) in enumerate(events):
        if kind == "add":
            length = min(length, max_len - 1)
            r = Request(f"r{n}", [family * 1000 + i for i in range(length)],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens))
            s.add_request(r)
            live.append(r)
        elif kind == "abort" and live:
            s.abort(live[length % len(live)].request_id)
        else:
            step(s)
        live = [r for r in live if not r.is_finished]
        for r in live:  # counters stay ordered
            assert r.num_computed_tokens <= r.prefill_len
            assert r.num_cached_tokens <= r.num_tokens
            assert len(r.block_ids) * block_size >= r.num_cached_tokens
    run_to_end(s, max_steps=2000)
    assert all(r.is_finished for r in live)
    assert_no_leak(s)
