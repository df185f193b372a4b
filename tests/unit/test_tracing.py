"""TraceEvent validation/serialisation and TraceRecorder behaviour (engine/tracing.py)."""

from __future__ import annotations

import threading

import msgpack
import pytest

from engine.tracing import (
    TraceEvent,
    TraceRecorder,
    events_from_dicts,
    events_to_dicts,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        self.t += 0.5
        return self.t


def test_event_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="end"):
        TraceEvent("r1", "prefill_chunk", "prefill-0", start=2.0, end=1.0)
    with pytest.raises(ValueError, match="request_id"):
        TraceEvent("", "token", "router", 1.0, 1.0)
    with pytest.raises(ValueError, match="bytes"):
        TraceEvent("r1", "kv_send", "link:a->b", 1.0, 2.0, bytes=-1)
    with pytest.raises(ValueError, match="token_end"):
        TraceEvent("r1", "prefill_chunk", "p", 1.0, 2.0, token_start=10, token_end=5)


def test_dict_roundtrip_is_compact_and_msgpack_friendly() -> None:
    e = TraceEvent(
        "r1", "prefill_chunk", "prefill-0", 10.0, 10.25,
        chunk_id=1, token_start=512, token_end=1024, scheduled_tokens=512, tenant="a",
    )  # fmt: skip
    d = e.to_dict()
    assert "bytes" not in d and d["chunk_id"] == 1
    assert TraceEvent.from_dict(d) == e
    wire = msgpack.packb(events_to_dicts([e, e]))
    assert events_from_dicts(msgpack.unpackb(wire)) == [e, e]
    assert e.duration == pytest.approx(0.25) and not e.is_instant
    with pytest.raises(ValueError, match="unknown"):
        TraceEvent.from_dict({**d, "bogus": 1})


def test_disabled_recorder_records_nothing() -> None:
    rec = TraceRecorder()
    rec.record("r1", "token")
    with rec.span("r1", "decode_step") as fields:
        fields["batch_num_seqs"] = 3
    assert len(rec) == 0 and rec.drain() == [] and rec.dropped == 0


def test_span_and_instant_use_clock_and_late_fields() -> None:
    clock = FakeClock()
    rec = TraceRecorder(enabled=True, worker="decode-0", clock=clock)
    with rec.span("r1", "decode_step", batch_num_seqs=2) as fields:
        fields["batch_num_tokens"] = 2
    rec.record("r1", "token", worker="router")
    rec.record("r2", "kv_send", start=5.0, end=6.0, worker="link:prefill-0->decode-0", bytes=4096)
    step, tok, send = rec.drain()
    assert (step.worker, step.batch_num_seqs, step.batch_num_tokens) == ("decode-0", 2, 2)
    assert step.duration == pytest.approx(0.5)
    assert tok.worker == "router" and tok.is_instant
    assert (send.bytes, send.duration) == (4096, 1.0)
    assert len(rec) == 0


def test_capacity_drops_new_events_and_counts_them() -> None:
    rec = TraceRecorder(enabled=True, worker="w", capacity=3)
    for i in range(5):
        rec.record(f"r{i}", "token", start=float(i))
    assert rec.dropped == 2
    assert [e.request_id for e in rec.drain()] == ["r0", "r1", "r2"]
    rec.record("r9", "token", start=9.0)
    assert len(rec) == 1 and rec.dropped == 2
    with pytest.raises(ValueError, match="capacity"):
        TraceRecorder(capacity=0)


def test_recorder_is_thread_safe() -> None:
    rec = TraceRecorder(enabled=True, worker="w")

    def work(k: int) -> None:
        for i in range(500):
            rec.record(f"t{k}-{i}", "token", start=float(i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = rec.drain()
    assert len(events) == 4000 and len({e.request_id for e in events}) == 4000


def test_invalid_record_is_skipped_at_drain_not_raised_in_the_worker() -> None:
    rec = TraceRecorder(enabled=True, worker="prefill-0")
    rec.record("r1", "prefill_chunk", start=2.0, end=1.0)  # end < start: a tracing bug
    rec.record("r1", "prefill_chunk", start=1.0, end=2.0, bogus_field=1)
    rec.record("r1", "prefill_chunk", start=1.0, end=2.0, chunk_id=0)
    rec.add(TraceEvent("r2", "token", "router", 3.0, 3.0))
    events = rec.drain()
    assert [(e.request_id, e.chunk_id) for e in events] == [("r1", 0), ("r2", None)]
    assert rec.invalid == 2 and rec.last_error is not None and "r1" in rec.last_error
