"""DecodeScheduler on an injected clock (the simulator's), and its owed-block total kept
incrementally: promised_free_blocks() equals the sum over every leg afresh at every point
of a lifecycle with chunk arrivals, growth into headroom, preemption, abort and finish."""

from __future__ import annotations

from decode_worker.scheduler import DecodeScheduler, DecodeSchedulerConfig
from engine.block_manager import BlockManager
from engine.request import RequestStatus, SamplingParams
from kv_transfer.pacing import ManualClock
from runtime.messages import DecodeTask

TOKEN = 5


def _task(leg: str, prompt: int, max_tokens: int) -> DecodeTask:
    return DecodeTask(leg, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _check(s: DecodeScheduler) -> None:
    assert s.promised_free_blocks() == s.bm.num_free_blocks - s.owed_blocks()
    assert s.promised_free_blocks() >= 0


def test_kv_wait_counts_on_the_injected_clock():
    clock = ManualClock(100.0)
    s = DecodeScheduler(DecodeSchedulerConfig(kv_wait_timeout_s=5.0), BlockManager(32, 4),
                        clock=clock)
    assert s.reserve(_task("a", 10, 4))
    assert s.pending["a"].since == 100.0
    clock.advance(4.0)
    s.allocate_range("a", 4)  # a chunk: the wait restarts at the clock's time
    assert s.pending["a"].since == 104.0
    clock.advance(5.0)
    assert s.expired() == []  # exactly the timeout: not yet
    assert s.touch(["a"]) == 1 and s.pending["a"].since == 109.0  # keepalive, same clock
    clock.advance(5.5)
    assert s.expired() == ["a"]
    s.abort("a")
    assert s.bm.num_used_blocks == 0 and s.owed_blocks() == 0 == s._owed_total


def test_owed_total_follows_every_transition():
    bm = BlockManager(10, 2, enable_prefix_caching=False)
    s = DecodeScheduler(DecodeSchedulerConfig(max_num_seqs=4, headroom_tokens=1), bm)
    for leg in ("a", "b", "c"):
        assert s.reserve(_task(leg, 5, 12))  # prompt + headroom: 6 tokens, 3 blocks
        _check(s)
    assert not s.reserve(_task("d", 5, 12))  # 3 x 3 promised of 10: no room for 3 more
    for leg in ("a", "b", "c"):
        for end in (2, 5):
            s.allocate_range(leg, end)
            _check(s)
        s.pending[leg].first_token, s.pending[leg].complete = TOKEN, True
        s.pending[leg].received_tokens = 5
        s.start(leg)
        _check(s)
    preempted_any = False
    while s.running:
        items, preempted = s.schedule()
        _check(s)
        preempted_any |= bool(preempted)
        for it in items:
            r = it.request
            r.num_cached_tokens += 1
            r.append_token(TOKEN)
            if r.is_finished:
                s.finish(r)
                _check(s)
    assert preempted_any, "the pool was sized so that growth beyond headroom preempts"
    assert bm.num_used_blocks == 0 and s.owed_blocks() == 0 == s._owed_total
    bm.check_integrity()


def test_abort_of_a_pending_and_a_running_leg_returns_what_they_owed():
    s = DecodeScheduler(DecodeSchedulerConfig(headroom_tokens=8), BlockManager(16, 4))
    assert s.reserve(_task("p", 9, 8)) and s.reserve(_task("r", 4, 8))
    s.allocate_range("p", 4)
    s.allocate_range("r", 4)
    s.pending["r"].first_token, s.pending["r"].complete = TOKEN, True
    s.start("r")
    _check(s)
    assert s.find_running("r") is not None and s.find_running("p") is None
    assert s.abort("r").status == RequestStatus.FINISHED_ABORTED
    _check(s)
    assert s.find_running("r") is None
    s.abort("p")
    _check(s)
    assert s.promised_free_blocks() == 16 and s.bm.num_used_blocks == 0
