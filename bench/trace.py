"""Trace export and analysis: Chrome/Perfetto JSON, summaries (the PNG: bench/plots.py).

Input is a merged list of :class:`engine.tracing.TraceEvent` (wall-clock seconds).
Each worker/link becomes one Perfetto process; its overlapping spans are spread over
lanes (threads) so that nothing is hidden. Slices are named by request id, so Perfetto
and the PNG both colour them by request and chunked-prefill interleaving is visible.

    write_chrome_trace(events, "trace.json")    # open in ui.perfetto.dev
    bench.plots.plot_timeline(events, "timeline.png")
    summarize(events).to_dict()
"""

from __future__ import annotations

import heapq
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.tracing import TraceEvent, events_from_dicts, events_to_dicts

_GROUP_ORDER = ("router", "prefill", "link:", "decode")


def _track_key(worker: str) -> tuple[int, str]:
    """Router first, then prefill workers, links, decode workers, anything else."""
    for i, prefix in enumerate(_GROUP_ORDER):
        if worker.startswith(prefix):
            return i, worker
    return len(_GROUP_ORDER), worker


def tracks(events: Iterable[TraceEvent]) -> list[str]:
    """Distinct worker/link names in display order."""
    return sorted({e.worker for e in events}, key=_track_key)


def assign_lanes(events: Sequence[TraceEvent]) -> list[int]:
    """Lane per event so spans in one lane never overlap (each span takes the lowest free
    lane at its start: the minimum number of lanes). Instants go to lane 0.
    Returned list is parallel to ``events``.
    """
    lanes = [0] * len(events)
    busy: list[tuple[float, int]] = []  # heap of (end, lane) of lanes in use
    free: list[int] = []  # heap of released lane numbers
    n_lanes = 0
    for i in sorted(range(len(events)), key=lambda k: (events[k].start, -events[k].end)):
        e = events[i]
        if e.is_instant:
            continue
        while busy and busy[0][0] <= e.start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lanes[i] = heapq.heappop(free)
        else:
            lanes[i], n_lanes = n_lanes, n_lanes + 1
        heapq.heappush(busy, (e.end, lanes[i]))
    return lanes


def by_track(events: Sequence[TraceEvent]) -> dict[str, list[TraceEvent]]:
    """Events grouped by worker/link, each group in input order."""
    out: dict[str, list[TraceEvent]] = defaultdict(list)
    for e in events:
        out[e.worker].append(e)
    return out


def _track_metadata(pid: int, worker: str, lanes: Iterable[int]) -> list[dict]:
    """Metadata events naming a track (a process) and its lanes (threads)."""
    m = {"ph": "M", "pid": pid, "tid": 0}
    out = [
        {**m, "name": "process_name", "args": {"name": worker}},
        {**m, "name": "process_sort_index", "args": {"sort_index": pid}},
    ]
    for k in sorted(set(lanes)):
        out.append(
            {
                **m,
                "name": "thread_name",
                "tid": k,
                "args": {"name": f"{worker} #{k}" if k else worker},
            }
        )
    return out


def to_chrome_trace(events: Sequence[TraceEvent], device: str | None = None) -> dict:
    """Chrome trace-event JSON (``{"traceEvents": [...]}``); times in µs from the first event.
    ``device``: the emulated accelerator's label, if the service ran on one."""
    t0 = min((e.start for e in events), default=0.0)
    out: list[dict] = []
    groups = by_track(events)
    for pid, worker in enumerate(tracks(events), start=1):
        evs = groups[worker]
        lanes = assign_lanes(evs)
        out += _track_metadata(pid, worker, lanes)
        for e, lane in zip(evs, lanes, strict=True):
            args = {k: v for k, v in e.to_dict().items() if k not in ("worker", "start", "end")}
            rec = {"name": e.request_id, "cat": e.phase, "pid": pid, "tid": lane, "args": args}
            rec["ts"] = (e.start - t0) * 1e6
            if e.is_instant:
                rec.update(ph="i", s="t", name=f"{e.phase} {e.request_id}")
            else:
                rec.update(ph="X", dur=e.duration * 1e6)
            out.append(rec)
    other = {"clock": "wall (time.time())", "t0_unix_s": t0, "num_events": len(events),
             **({"device": device} if device else {})}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def out_path(path: str | Path) -> Path:
    """``path`` as a Path whose parent directory exists."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_chrome_trace(events: Sequence[TraceEvent], path: str | Path,
                       device: str | None = None) -> Path:
    """Write :func:`to_chrome_trace` to ``path`` (open in ui.perfetto.dev / chrome://tracing)."""
    path = out_path(path)
    path.write_text(json.dumps(to_chrome_trace(events, device)), encoding="utf-8")
    return path


def save_events(events: Iterable[TraceEvent], path: str | Path) -> Path:
    """Raw events as JSON lines, to re-plot or re-summarise later."""
    path = out_path(path)
    path.write_text("".join(json.dumps(d) + "\n" for d in events_to_dicts(events)), "utf-8")
    return path


def load_events(path: str | Path) -> list[TraceEvent]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return events_from_dicts(json.loads(line) for line in lines if line.strip())


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _intersection(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total overlap of two disjoint, sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def request_ids(event: TraceEvent) -> list[str]:
    """Requests an event covers: batch-level events carry ``"id1,id2"`` (or ``"*"``: all)."""
    return event.request_id.split(",")


def transfer_overlap(events: Iterable[TraceEvent]) -> dict[str, float]:
    """Per request: share of its kv_send time that overlaps its own prefill spans
    (``prefill_chunk`` events, or ``prefill_step`` events that list the request).

    1.0 means every byte moved while the prompt was still being prefilled (perfect
    streaming); 0.0 means the transfer started after prefill ended. Requests without
    kv_send time are left out.
    """
    sends: dict[str, list] = defaultdict(list)
    chunks: dict[str, list] = defaultdict(list)
    for e in events:
        if e.phase == "kv_send" and not e.is_instant:
            sends[e.request_id].append((e.start, e.end))
        elif e.phase in ("prefill_chunk", "prefill_step"):
            for rid in request_ids(e):
                chunks[rid].append((e.start, e.end))
    out = {}
    for rid, spans in sends.items():
        s = _merge(spans)
        out[rid] = _intersection(s, _merge(chunks.get(rid, []))) / sum(b - a for a, b in s)
    return out


def link_utilization(
    events: Sequence[TraceEvent], window: tuple[float, float] | None = None
) -> dict[str, float]:
    """Per link (worker of kv_send events): busy time (union of sends) / window length.

    ``window`` defaults to the whole trace (first start .. last end).
    """
    if window is None:
        window = (min(e.start for e in events), max(e.end for e in events)) if events else (0, 0)
    w0, w1 = window
    busy: dict[str, list] = defaultdict(list)
    for e in events:
        if e.phase == "kv_send":
            busy[e.worker].append((max(e.start, w0), min(e.end, w1)))
    span = w1 - w0
    busy_s = {k: sum(b - a for a, b in _merge(v)) for k, v in busy.items()}
    return {k: (v / span if span > 0 else 0.0) for k, v in busy_s.items()}


def step_times(events: Iterable[TraceEvent], phase: str = "prefill_chunk") -> list[float]:
    """Durations of distinct steps: spans of ``phase`` with the same (worker, start, end)
    are one batched step, counted once."""
    steps = {(e.worker, e.start, e.end) for e in events if e.phase == phase}
    return [end - start for _, start, end in sorted(steps, key=lambda s: s[1])]


@dataclass(frozen=True)
class TraceSummary:
    """Headline numbers of a trace; ``*_s`` in seconds, overlap/utilisation in [0, 1]."""

    num_events: int
    num_requests: int
    span_s: float
    transfer_overlap_mean: float | None
    transfer_overlap: dict[str, float]
    link_utilization: dict[str, float]
    link_bytes: dict[str, int]
    mean_prefill_step_s: float | None
    mean_decode_step_s: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(events: Sequence[TraceEvent]) -> TraceSummary:
    """Headline numbers of a trace (see :func:`transfer_overlap`, :func:`link_utilization`)."""
    ov = transfer_overlap(events)
    link_bytes: dict[str, int] = defaultdict(int)
    for e in events:
        if e.phase == "kv_send" and e.bytes is not None:
            link_bytes[e.worker] += e.bytes
    pre = step_times(events, "prefill_step") or step_times(events, "prefill_chunk")
    dec = step_times(events, "decode_step")
    return TraceSummary(
        num_events=len(events),
        num_requests=len({r for e in events for r in request_ids(e)} - {"*"}),
        span_s=(max(e.end for e in events) - min(e.start for e in events)) if events else 0.0,
        transfer_overlap_mean=sum(ov.values()) / len(ov) if ov else None,
        transfer_overlap=ov,
        link_utilization=link_utilization(events),
        link_bytes=dict(link_bytes),
        mean_prefill_step_s=sum(pre) / len(pre) if pre else None,
        mean_decode_step_s=sum(dec) / len(dec) if dec else None,
    )
