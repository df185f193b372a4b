"""Request state machine and colocated scheduling policy, driven step by step with fake
runner outputs (no model): WAITING -> PREFILLING -> RUNNING -> FINISHED_*, the counters of
docs/design.md §5, chunked prefill on (decode-first budget) and off (whole prompt, prefill-first),
and max_num_seqs. Every test ends with a leak check."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from tests.sched_steps import FAKE_TOKEN, assert_no_leak
from tests.sched_steps import run_to_end as drain

S = RequestStatus
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(rid: str, n: int, max_tokens: int = 3, base: int = 100, eos=(), **sp) -> Request:
    sp.setdefault("temperature", 0.0)
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens, **sp),
                   eos_token_ids=tuple(eos))


def sched(num_blocks: int = 64, block_size: int = 4, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", num_blocks * block_size)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))


def step(s: Scheduler, token: int = FAKE_TOKEN) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    sampled = {i.request.request_id: token for i in out.items if i.to_chunk().sample}
    touched = s.update(out, sampled)
    s.bm.check_integrity()
    return out, touched


def shape(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(i.request.request_id, i.start, i.num_tokens, i.is_prefill) for i in out.items]


# ---- the state machine ---------------------------------------------------------------
def test_waiting_prefilling_running_finished_length_with_counters():
    s = sched(max_num_batched_tokens=4)
    r = make("a", 10, max_tokens=3)
    s.add_request(r)
    assert r.status == S.WAITING
    # chunks 4 / 4 / 2: a PREFILLING request produces no user-visible output
    for computed in (4, 8):
        out, touched = step(s)
        assert shape(out) == [("a", computed - 4, 4, True)]
        assert not out.items[0].to_chunk().sample  # no logits for a partial prefill
        assert r.status == S.PREFILLING and touched == [] and r.output_token_ids == []
        assert r.num_computed_tokens == r.num_cached_tokens == computed
        assert r.first_token_time is None
    out, touched = step(s)
    assert shape(out) == [("a", 8, 2, True)] and out.items[0].completes_prefill
    # after prefill: computed = cached = prompt_len and exactly one output token
    assert r.status == S.RUNNING and touched == [r]
    assert r.num_computed_tokens == r.num_cached_tokens == 10
    assert r.output_token_ids == [FAKE_TOKEN] and r.first_token_time is not None
    # the first decode feeds that token and writes its KV
    out, _ = step(s)
    assert shape(out) == [("a", 10, 1, False)]
    assert r.num_cached_tokens == 11 and r.num_computed_tokens == 10
    step(s)
    assert r.status == S.FINISHED_LENGTH and r.finish_reason.value == "length"
    assert len(r.output_token_ids) == 3 and r not in s.running
    assert_no_leak(s)


def test_waiting_goes_straight_to_running_when_one_chunk_holds_the_prompt():
    s = sched(max_num_batched_tokens=16)
    r = make("a", 10, max_tokens=2)
    s.add_request(r)
    out = s.schedule()
    assert shape(out) == [("a", 0, 10, True)] and out.items[0].completes_prefill
    assert r.status == S.WAITING  # never PREFILLING
    s.update(out, {"a": 3})
    assert r.status == S.RUNNING and r.output_token_ids == [3]
    assert r.num_computed_tokens == r.num_cached_tokens == 10
    drain(s)
    assert r.status == S.FINISHED_LENGTH
    assert_no_leak(s)


def test_stop_token_finishes_stopped_and_is_kept_in_the_output():
    s = sched()
    r = make("a", 5, max_tokens=10, stop_token_ids=(9,))
    s.add_request(r)
    step(s)
    step(s, token=9)
    assert r.status == S.FINISHED_STOPPED and r.finish_reason.value == "stop"
    assert r.output_token_ids == [FAKE_TOKEN, 9]
    assert_no_leak(s)


def test_eos_finishes_stopped_unless_ignore_eos():
    s = sched()
    stops = make("a", 5, max_tokens=10, eos=(2,))
    ignores = make("b", 5, max_tokens=3, eos=(2,), ignore_eos=True, base=300)
    s.add_request(stops)
    s.add_request(ignores)
    step(s, token=2)
    assert stops.status == S.FINISHED_STOPPED and stops.output_token_ids == [2]
    assert ignores.status == S.RUNNING
    drain(s)
    assert ignores.status == S.FINISHED_LENGTH and ignores.output_token_ids[0] == 2
    assert_no_leak(s)


def test_reaching_max_model_len_finishes_with_length():
    s = sched(max_model_len=12)
    r = make("a", 9, max_tokens=100)
    s.add_request(r)
    drain(s)
    assert r.status == S.FINISHED_LENGTH and r.num_tokens == 12
    assert_no_leak(s)


# ---- chunked prefill on: decode-first budget ---------------------------------------
def test_decode_first_budget_then_partial_prefills_then_new_prompts():
    s = sched(max_num_batched_tokens=10)
    decoders = [make(f"d{i}", 3, max_tokens=20, base=100 * (i + 1)) for i in range(3)]
    for r in decoders:
        s.add_request(r)
    step(s)  # 3 prompts of 3 tokens fit in one step
    assert all(r.status == S.RUNNING for r in decoders)
    long_a = make("la", 12, max_tokens=2, base=1000)
    long_b = make("lb", 12, max_tokens=2, base=2000)
    s.add_request(long_a)
    s.add_request(long_b)
    out, _ = step(s)
    # decodes first (1 token each), then the new prompt takes what is left of the budget
    assert shape(out) == [("d0", 3, 1, False), ("d1", 3, 1, False), ("d2", 3, 1, False),
                          ("la", 0, 7, True)]
    assert out.num_tokens == 10 and long_a.status == S.PREFILLING
    out, _ = step(s)
    # the partial prefill continues before the next waiting prompt is admitted
    assert shape(out)[3:] == [("la", 7, 5, True), ("lb", 0, 2, True)]
    assert out.num_tokens == 10
    drain(s)
    assert_no_leak(s)


def test_max_prefill_chunk_caps_each_chunk_below_the_budget():
    s = sched(max_num_batched_tokens=64, max_prefill_chunk=5)
    r = make("a", 12, max_tokens=1)
    s.add_request(r)
    sizes = []
    while r.status in (S.WAITING, S.PREFILLING):
        out, _ = step(s)
        sizes += [i.num_tokens for i in out.items]
    assert sizes == [5, 5, 2]
    assert_no_leak(s)


# ---- chunked prefill off: whole prompts, prefill-first -----------------------------
def test_chunked_prefill_off_runs_whole_prompt_in_one_step_prefill_first():
    s = sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    first = make("a", 20, max_tokens=4)  # longer than the token budget: still one step
    s.add_request(first)
    out, _ = step(s)
    assert shape(out) == [("a", 0, 20, True)] and first.status == S.RUNNING
    out, _ = step(s)
    assert shape(out) == [("a", 20, 1, False)]
    second = make("b", 30, max_tokens=2, base=500)
    s.add_request(second)
    out, _ = step(s)
    assert shape(out) == [("b", 0, 30, True)]  # prefill-first: no decode rides along
    assert len(first.output_token_ids) == 2
    out, _ = step(s)
    assert shape(out) == [("a", 21, 1, False), ("b", 30, 1, False)]
    drain(s)
    assert first.status == second.status == S.FINISHED_LENGTH
    assert_no_leak(s)


# ---- max_num_seqs --------------------------------------------------------------------
def test_max_num_seqs_bounds_the_running_set():
    s = sched(max_num_batched_tokens=64, max_num_seqs=2)
    reqs = [make(f"r{i}", 4, max_tokens=3, base=100 * (i + 1)) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    finished_order = []
    for _ in range(100):
        if not s.has_unfinished:
            break
        out, touched = step(s)
        assert len(s.running) <= 2
        assert len({i.request.request_id for i in out.items}) <= 2
        finished_order += [r.request_id for r in touched if r.is_finished]
    assert finished_order == [r.request_id for r in reqs]  # FIFO admission
    assert_no_leak(s)


def test_request_status_order_and_terminal_states():
    assert [s for s in S if s.is_finished] == [
        S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED, S.FINISHED_ERROR]
    assert S.WAITING < S.PREFILLING < S.RUNNING < S.FINISHED_STOPPED
    s = sched()
    assert not s.has_unfinished and s.schedule().items == []
    assert_no_leak(s)
