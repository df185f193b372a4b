"""BlockManager lifecycles driven step by step through the scheduler with fake runner
outputs: abort in every state, preemption by recompute, prefix-cache sharing and LRU
eviction. Every test ends with a leak check (integrity holds, zero used blocks)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, block_hashes, chain_hash
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

FAKE_TOKEN = 7


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: a second OpenMP thread only adds barrier waits on a busy 2-core box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make(rid: str, n: int, max_tokens: int = 4, base: int = 100, **sp) -> Request:
    """A request whose prompt is `n` distinct tokens starting at `base`."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sp)
    return Request(rid, list(range(base, base + n)), params)


def sched(num_blocks: int, block_size: int = 4, prefix: bool = True, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", num_blocks * block_size)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, prefix))


def step(s: Scheduler, tokens: dict[str, int] | None = None) -> SchedulerOutput:
    """One step with a fake runner: every sampled row gets FAKE_TOKEN (or `tokens[rid]`)."""
    out = s.schedule()
    sampled = {
        i.request.request_id: (tokens or {}).get(i.request.request_id, FAKE_TOKEN)
        for i in out.items
        if i.to_chunk().sample
    }
    s.update(out, sampled)
    s.bm.check_integrity()
    return out


def run_to_end(s: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished:
            return
        step(s)
    raise AssertionError("scheduler did not drain")


def assert_no_leak(s: Scheduler) -> None:
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0
    assert not s.has_unfinished


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


# ---- prefix cache -------------------------------------------------------------------
def test_prefix_blocks_are_shared_by_two_live_requests_with_refcounts():
    s = sched(16, max_num_batched_tokens=64)
    a = make("a", 10, max_tokens=3)  # blocks [0..3] [4..7] full, [8, 9] partial
    s.add_request(a)
    step(s)
    shared = a.block_ids[:2]
    b = Request("b", a.prompt_token_ids[:8] + [900, 901, 902],
                SamplingParams(temperature=0.0, max_tokens=3))
    s.add_request(b)
    step(s)  # a decodes, b is admitted with a 2-block prefix hit
    assert b.prefix_hit_tokens == 8 and b.block_ids[:2] == shared
    assert b.num_computed_tokens == b.num_cached_tokens == 11
    assert [s.bm._ref[x] for x in shared] == [2, 2]
    assert s.bm.prefix_hits == 1
    used_both, a_private = s.bm.num_used_blocks, len(a.block_ids) - len(shared)
    s.abort("a")  # shared blocks survive with one reference
    assert [s.bm._ref[x] for x in shared] == [1, 1]
    assert s.bm.num_used_blocks == used_both - a_private
    run_to_end(s)
    assert b.status == RequestStatus.FINISHED_LENGTH
    # freed hashed blocks stay cached (reusable), but none is in use
    assert all(x in s.bm._cached_free for x in shared)
    assert_no_leak(s)


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    s = sched(16, max_num_batched_tokens=64)
    a = make("a", 8, max_tokens=1)  # exactly two full blocks
    s.add_request(a)
    run_to_end(s)
    b = make("b", 8, max_tokens=1)  # the same prompt
    s.add_request(b)
    out = step(s)
    assert b.prefix_hit_tokens == 4  # the last block is recomputed to get logits
    assert out.items[0].start == 4 and out.items[0].num_tokens == 4
    assert_no_leak(s)


def test_lru_eviction_reuses_the_oldest_cached_blocks_and_cleans_hash_maps():
    s = sched(6, max_num_batched_tokens=64)
    bm = s.bm
    a = make("a", 9, max_tokens=1, base=100)  # 2 full blocks hashed + 1 partial
    b = make("b", 9, max_tokens=1, base=500)
    for r in (a, b):
        s.add_request(r)
        run_to_end(s)
    assert len(bm._hash_to_block) == 4 and len(bm._cached_free) == 4
    assert len(bm._free) == 2
    a_blocks = bm.match_prefix(a.prompt_token_ids)
    b_blocks = bm.match_prefix(b.prompt_token_ids)
    assert len(a_blocks) == len(b_blocks) == 2
    # free list (2 blocks) runs dry; the next 2 blocks come from the LRU, oldest first:
    # a's blocks entered first, tail block first
    c = make("c", 15, max_tokens=2, base=900)
    s.add_request(c)
    step(s)
    assert set(c.block_ids) >= set(a_blocks)
    assert bm.match_prefix(a.prompt_token_ids) == []
    assert bm.match_prefix(b.prompt_token_ids) == b_blocks
    # a's hashes are gone from both maps (the blocks now hold c's tokens)
    for h in block_hashes(a.prompt_token_ids, 4):
        assert h not in bm._hash_to_block
    for x in a_blocks:
        assert bm._block_to_hash.get(x) in (None, *block_hashes(c.prompt_token_ids, 4))
    run_to_end(s)
    assert_no_leak(s)


def test_lru_eviction_takes_the_tail_block_of_the_oldest_prefix_first():
    s = sched(4, max_num_batched_tokens=64)
    bm = s.bm
    a = make("a", 9, max_tokens=1)  # blocks: 2 full (hashed) + 1 partial
    s.add_request(a)
    run_to_end(s)
    head, tail = bm.match_prefix(a.prompt_token_ids)
    c = make("c", 11, max_tokens=2, base=700)  # needs 3 blocks: 2 free + 1 evicted
    s.add_request(c)
    step(s)
    assert tail in c.block_ids and head not in c.block_ids
    assert bm.match_prefix(a.prompt_token_ids) == [head]  # the shorter prefix still hits
    run_to_end(s)
    assert_no_leak(s)


def test_prefix_hit_refreshes_lru_position():
    s = sched(7, max_num_batched_tokens=64)
    bm = s.bm
    a = make("a", 9, max_tokens=1, base=100)
    b = make("b", 9, max_tokens=1, base=500)
    for r in (a, b):
        s.add_request(r)
        run_to_end(s)
    a_blocks = bm.match_prefix(a.prompt_token_ids)
    a2 = make("a2", 9, max_tokens=1, base=100)  # hits a's blocks: they become newest
    s.add_request(a2)
    run_to_end(s)
    assert a2.prefix_hit_tokens == 8
    b_blocks = bm.match_prefix(b.prompt_token_ids)
    c = make("c", 19, max_tokens=2, base=900)  # 5 blocks: 3 free + 2 from the LRU
    s.add_request(c)
    step(s)
    assert set(b_blocks) <= set(c.block_ids)  # b's were the oldest now
    assert bm.match_prefix(b.prompt_token_ids) == []
    assert bm.match_prefix(a.prompt_token_ids) == a_blocks
    run_to_end(s)
    assert_no_leak(s)


def test_reset_prefix_cache_returns_cached_blocks_to_the_free_list():
    s = sched(8, max_num_batched_tokens=64)
    a = make("a", 13, max_tokens=1)
    s.add_request(a)
    run_to_end(s)
    assert s.bm._cached_free
    s.bm.reset_prefix_cache()
    assert not s.bm._cached_free and not s.bm._hash_to_block and not s.bm._block_to_hash
    assert s.bm.match_prefix(a.prompt_token_ids) == []
    assert_no_leak(s)


def test_prefix_caching_off_never_hashes():
    s = sched(8, max_num_batched_tokens=64, prefix=False)
    for rid in ("a", "b"):
        s.add_request(make(rid, 13, max_tokens=2))
        run_to_end(s)
    assert not s.bm._hash_to_block and s.bm.prefix_queries == 0
    assert_no_leak(s)


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


def test_block_hashes_chain_over_full_blocks_only():
    h = block_hashes(list(range(10)), 4)
    assert len(h) == 2
    assert block_hashes(list(range(8)) + [99], 4) == h  # same full blocks, same chain
    assert block_hashes([0, 1, 2, 3, 9, 5, 6, 7], 4)[1] != h[1]  # parent change propagates
    assert block_hashes([1, 2, 3], 4) == [] and block_hashes([], 4) == []
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_block_hashes_are_xxh3_128_of_parent_and_little_endian_int32_tokens():
    import struct

    import xxhash

    tokens = [5, 70000, 0, 2**31 - 1, 9, 9, 9, 9]
    first = xxhash.xxh3_128_digest(bytes(16) + struct.pack("<4i", *tokens[:4]))
    second = xxhash.xxh3_128_digest(first + struct.pack("<4i", *tokens[4:]))
    assert block_hashes(tokens, 4) == [first, second]
    assert chain_hash(first, tokens[4:]) == second
    # an id beyond int32 packs as int64: twice the bytes, so never the input of an int32 block
    wide = block_hashes([2**40, 1, 2, 3], 4)
    assert wide == [xxhash.xxh3_128_digest(bytes(16) + struct.pack("<4q", 2**40, 1, 2, 3))]


def test_block_hashes_are_the_same_in_every_process():
    """The router and every worker hash prompts in their own processes (and Python's
    str/bytes hash is salted per process): the chain must not depend on the process."""
    import subprocess
    import sys

    code = ("from engine.block_manager import block_hashes; "
            "print(','.join(h.hex() for h in block_hashes(list(range(3, 200, 7)), 5)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2", "random")}
    assert outs == {",".join(h.hex() for h in block_hashes(list(range(3, 200, 7)), 5))}


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
