"""A configuration's trace: exported files (Perfetto JSON, timeline PNG) and summaries.

On an emulated link the exported files also show each KV frame as it occupies that link
(``link:... (emulated)`` tracks); the summaries stretch the ``kv_send`` spans the same
way (``bench.studies.link.emulate_link_spans``) but count each frame once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.tracing import TraceEvent

if TYPE_CHECKING:
    from bench.studies.config_run import ConfigRun


def write_trace_files(out: Path, study: str, config: str, events: Sequence[TraceEvent],
                      device: str | None = None) -> dict[str, str]:
    """``STUDY-CONFIG.trace.json`` (Perfetto) and ``STUDY-CONFIG.timeline.png``;
    ``device``: the emulated accelerator's label, in both."""
    from bench.plots import plot_timeline
    from bench.trace import write_chrome_trace

    stem = f"{study}-{slug(config)}"
    trace = write_chrome_trace(events, out / f"{stem}.trace.json", device)
    png = plot_timeline(events, out / f"{stem}.timeline.png",
                        title=f"{study}: {config}" + (f" ({device})" if device else ""))
    return {"trace": trace.name, "timeline": png.name}


def with_emulated_link(events: Sequence[TraceEvent], link_gbps: float | None,
                       ) -> list[TraceEvent]:
    """``events`` plus, on an emulated link, each kv_send as it occupies that link (on a
    track of its own, ``link:... (emulated)``), so the timeline shows the link's load.
    For the exported files only: summaries use the raw events (no double counting)."""
    if not link_gbps:
        return list(events)
    from dataclasses import replace

    from bench.studies.link import emulate_link_spans

    sends = [e for e in events if e.phase == "kv_send"]
    return [*events, *(replace(e, worker=f"{e.worker} (emulated)")
                       for e in emulate_link_spans(sends, link_gbps))]


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "config"


def trace_metrics(run: ConfigRun) -> dict[str, Any]:
    """Transfer overlap (time-weighted over requests, and the plain per-request mean), link
    utilisation and step times from a run's trace; kv_send spans are stretched to the
    emulated link (when the config emulates one)."""
    from bench.studies.link import emulate_link_spans
    from bench.trace import summarize

    events = run.events
    if not events:
        return {}
    gbps = run.cfg.transfer.link_gbps
    events = emulate_link_spans(events, gbps) if gbps else events
    s = summarize(events)
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {"num_events": s.num_events, "transfer_overlap": weighted_overlap(events),
            "transfer_overlap_request_mean": s.transfer_overlap_mean,
            "link_utilization": max(s.link_utilization.values(), default=None),
            "link_bytes": sum(s.link_bytes.values()), "span_s": s.span_s,
            "trace_prefill_step_ms": ms(s.mean_prefill_step_s),
            "trace_decode_step_ms": ms(s.mean_decode_step_s)}


def weighted_overlap(events: Sequence[TraceEvent]) -> float | None:
    """Share of all transfer time (summed over requests) that overlapped the sending
    request's own prefill: long prompts, which move most bytes, weigh most."""
    from bench.trace import transfer_overlap

    per_request = transfer_overlap(events)
    busy: dict[str, float] = {}
    for e in events:
        if e.phase == "kv_send" and e.request_id in per_request:
            busy[e.request_id] = busy.get(e.request_id, 0.0) + e.duration
    total = sum(busy.values())
    return sum(per_request[r] * b for r, b in busy.items()) / total if total > 0 else None
