"""Trace export (Chrome JSON) and summaries (bench/trace.py), the timeline PNG (bench/plots.py)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from bench.plots import plot_timeline
from bench.trace import (
    assign_lanes,
    link_utilization,
    load_events,
    save_events,
    step_times,
    summarize,
    to_chrome_trace,
    tracks,
    transfer_overlap,
    write_chrome_trace,
)
from engine.tracing import TraceEvent

T0 = 1_700_000_000.0
LINK = "link:prefill-0->decode-0"


def chunked_prefill_scenario() -> list[TraceEvent]:
    """A 4-chunk long prompt interleaving with a short request that then streams tokens."""
    ev = []

    def add(rid: str, phase: str, worker: str, s: float, e: float, **kw: object) -> None:
        ev.append(TraceEvent(rid, phase, worker, T0 + s, T0 + e, **kw))  # type: ignore[arg-type]

    add("long", "queue", "router", 0.0, 0.01)
    add("short", "queue", "router", 0.05, 0.06)
    for c in range(4):  # long prompt: 4 chunks of 512 tokens, one prefill step each
        s = 0.01 + 0.1 * c
        add("long", "prefill_chunk", "prefill-0", s, s + 0.1, chunk_id=c,
            token_start=512 * c, token_end=512 * (c + 1), past_kv_tokens=512 * c,
            batch_num_seqs=2 if c == 1 else 1)  # fmt: skip
        add("long", "kv_send", LINK, s + 0.1, s + 0.15, chunk_id=c, bytes=1 << 20)
    add(
        "short",
        "prefill_chunk",
        "prefill-0",
        0.11,
        0.21,
        chunk_id=0,
        token_start=0,
        token_end=64,
        batch_num_seqs=2,
    )  # fmt: skip  (batched with long's chunk 1)
    add("short", "kv_send", LINK, 0.21, 0.23, chunk_id=0, bytes=1 << 16)
    add("short", "kv_recv", "decode-0", 0.23, 0.24)
    add("short", "decode_admit", "decode-0", 0.24, 0.24)
    for k in range(5):  # short streams while long still prefills
        s = 0.25 + 0.04 * k
        add("short", "decode_step", "decode-0", s, s + 0.03, batch_num_seqs=1)
        add("short", "token", "router", s + 0.031, s + 0.031)
    return ev


def test_tracks_are_grouped_and_lanes_never_overlap() -> None:
    ev = chunked_prefill_scenario()
    assert tracks(ev) == ["router", "prefill-0", LINK, "decode-0"]
    prefill = [e for e in ev if e.worker == "prefill-0"]
    lanes = assign_lanes(prefill)
    by_lane = defaultdict(list)
    for e, lane in zip(prefill, lanes, strict=True):
        by_lane[lane].append((e.start, e.end))
    assert len(by_lane) == 2  # long chunk 1 and short's chunk share one step
    for spans in by_lane.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_chrome_trace_is_valid_json_with_named_tracks(tmp_path: Path) -> None:
    ev = chunked_prefill_scenario()
    path = write_chrome_trace(ev, tmp_path / "sub" / "trace.json")
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    procs = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(procs) == {"router", "prefill-0", LINK, "decode-0"}
    assert any(e["name"] == "thread_name" and e["pid"] == procs["prefill-0"] for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    instants = [e for e in events if e["ph"] == "i"]
    assert len(complete) + len(instants) == len(ev)
    assert len(instants) == 6  # 5 tokens + decode_admit
    chunk = next(e for e in complete if e["cat"] == "prefill_chunk" and e["args"]["chunk_id"] == 2)
    assert chunk["pid"] == procs["prefill-0"] and chunk["name"] == "long"
    assert chunk["ts"] == pytest.approx(0.21e6) and chunk["dur"] == pytest.approx(0.1e6)
    assert chunk["args"]["token_start"] == 1024
    assert min(e["ts"] for e in complete) == 0.0
    assert doc["otherData"]["t0_unix_s"] == T0


def test_timeline_png_written(tmp_path: Path) -> None:
    ev = chunked_prefill_scenario()
    for name, kwargs in (
        ("all.png", {"title": "demo"}),
        ("zoom.png", {"window": (0.1, 0.3), "requests": ["short"]}),
        ("empty.png", {"requests": []}),
    ):
        data = plot_timeline(ev, tmp_path / name, **kwargs).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 3000


def test_transfer_overlap_on_hand_made_spans() -> None:
    ev = [
        TraceEvent("r", "prefill_chunk", "p", 0.0, 1.0),
        TraceEvent("r", "prefill_chunk", "p", 2.0, 3.0),
        TraceEvent("r", "kv_send", LINK, 0.5, 1.5),  # half inside chunk 0
        TraceEvent("r", "kv_send", LINK, 2.5, 3.5),  # half inside chunk 1
        TraceEvent("q", "prefill_chunk", "p", 0.0, 1.0),
        TraceEvent("q", "kv_send", LINK, 1.0, 2.0),  # after its prefill: no overlap
        TraceEvent("x", "prefill_chunk", "p", 0.0, 4.0),  # another request's chunk
    ]
    assert transfer_overlap(ev) == pytest.approx({"r": 0.5, "q": 0.0})


def test_link_utilization_and_step_times() -> None:
    ev = [
        TraceEvent("a", "kv_send", LINK, 0.0, 1.0, bytes=100),
        TraceEvent("b", "kv_send", LINK, 0.5, 1.5, bytes=50),  # overlaps a: union 1.5 s
        TraceEvent("a", "prefill_chunk", "prefill-0", 0.0, 0.2),
        TraceEvent("b", "prefill_chunk", "prefill-0", 0.0, 0.2),  # same batched step
        TraceEvent("a", "prefill_chunk", "prefill-0", 0.2, 0.6),
        TraceEvent("a", "token", "router", 3.0, 3.0),
    ]
    assert link_utilization(ev) == pytest.approx({LINK: 0.5})  # 1.5 busy / 3.0 trace
    assert link_utilization(ev, window=(0.0, 1.0)) == pytest.approx({LINK: 1.0})
    assert step_times(ev) == pytest.approx([0.2, 0.4])
    s = summarize(ev)
    assert s.link_bytes == {LINK: 150} and s.num_requests == 2
    assert s.mean_prefill_step_s == pytest.approx(0.3) and s.mean_decode_step_s is None
    assert s.span_s == pytest.approx(3.0)
    json.dumps(s.to_dict())


def test_scenario_summary_and_event_file_roundtrip(tmp_path: Path) -> None:
    ev = chunked_prefill_scenario()
    s = summarize(ev)
    assert s.transfer_overlap["long"] == pytest.approx(0.15 / 0.2)  # last send after prefill
    assert s.transfer_overlap["short"] == 0.0
    assert load_events(save_events(ev, tmp_path / "events.jsonl")) == ev
    assert to_chrome_trace([])["traceEvents"] == []


def test_batch_level_step_events_are_understood(tmp_path: Path) -> None:
    """Workers may record one event per step: prefill_step "a,b" and decode_step "*"."""
    ev = [
        TraceEvent("a,b", "prefill_step", "prefill-0", 0.0, 1.0, batch_num_seqs=2),
        TraceEvent("a", "prefill_step", "prefill-0", 1.0, 1.5, batch_num_seqs=1),
        TraceEvent("a", "kv_send", LINK, 0.5, 1.5),  # fully inside a's prefill steps
        TraceEvent("b", "kv_send", LINK, 1.0, 2.0),  # b's prefill ended at 1.0
        TraceEvent("*", "decode_step", "decode-0", 2.0, 2.1, batch_num_seqs=2),
        TraceEvent("*", "decode_step", "decode-0", 2.1, 2.3, batch_num_seqs=2),
    ]
    assert transfer_overlap(ev) == pytest.approx({"a": 1.0, "b": 0.0})
    s = summarize(ev)
    assert s.num_requests == 2
    assert s.mean_prefill_step_s == pytest.approx(0.75)
    assert s.mean_decode_step_s == pytest.approx(0.15)
    assert plot_timeline(ev, tmp_path / "batch.png").stat().st_size > 3000
