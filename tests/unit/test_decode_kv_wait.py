"""The decode worker's KV wait: it counts from the latest sign of life (reservation, a KV
chunk, or the router's keepalive while the prefill is queued), not from the reservation."""

from __future__ import annotations

from decode_worker.scheduler import DecodeScheduler, DecodeSchedulerConfig
from engine.block_manager import BlockManager
from engine.request import SamplingParams
from runtime.messages import DecodeTask


def _sched(timeout: float = 10.0) -> DecodeScheduler:
    s = DecodeScheduler(DecodeSchedulerConfig(kv_wait_timeout_s=timeout), BlockManager(64, 16))
    assert s.reserve(DecodeTask("a", 40, SamplingParams(max_tokens=4), ()))
    assert s.reserve(DecodeTask("b", 40, SamplingParams(max_tokens=4), ()))
    return s


def test_a_silent_reservation_expires_after_the_timeout():
    s = _sched()
    t0 = s.pending["a"].since
    assert s.expired(t0 + 9.0) == []
    assert sorted(s.expired(t0 + 10.5)) == ["a", "b"]


def test_keepalive_and_arriving_chunks_restart_the_wait():
    s = _sched()
    t0 = s.pending["a"].since
    assert s.touch(["a", "unknown"], t0 + 8.0) == 1  # the prefill is still queued
    assert s.expired(t0 + 12.0) == ["b"]
    s.pending["b"].since = t0 - 100.0  # long silent...
    s.allocate_range("b", 16)  # ...then a chunk arrives: progress
    assert s.pending["b"].since >= t0 and s.expired(t0 + 9.0) == []
    assert s.expired(t0 + 18.5 + (s.pending["b"].since - t0)) == ["a", "b"]
    for rid in ("a", "b"):
        s.abort(rid)
    assert s.bm.num_used_blocks == 0 and not s.pending
