"""Trace events of a simulated run, in the format the real traces use (engine/tracing.py
TraceEvent phases and fields; bench/trace.py writes the Perfetto JSON).

Times are simulated seconds from the start of the run; the written file says so
(``otherData.clock``) and carries the cost model's label ("analytic, not measured" for an
analytic profile), so a simulated trace is never mistaken for a measured one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.adapters import TraceEvent


class SimTracer:
    """Collects spans cheaply (tuples) and builds TraceEvents at the end."""

    enabled = True  # engine/tracing.py TraceRecorder's face, for the real engines' records

    def __init__(self) -> None:
        self._spans: list[tuple] = []

    def record(self, request_id: str, phase: str, start: float, end: float, *, worker: str,
               **fields: Any) -> None:
        self._spans.append((request_id, phase, worker, start, end, fields))

    def span(self, request_id: str, phase: str, worker: str, start: float, end: float,
             **fields: Any) -> None:
        self._spans.append((request_id, phase, worker, start, end, fields))

    def __len__(self) -> int:
        return len(self._spans)

    def events(self) -> list[TraceEvent]:
        return [TraceEvent(rid, phase, worker, start, end, **fields)
                for rid, phase, worker, start, end, fields in self._spans]


def write_sim_trace(events: list[TraceEvent], path: str | Path, label: str) -> Path:
    """Perfetto/Chrome JSON of simulated events (bench/trace.py's layout)."""
    from bench.trace import out_path, to_chrome_trace

    doc = to_chrome_trace(events)
    doc["otherData"].update(clock="simulated seconds (pdserve simulate)", cost_model=label)
    path = out_path(path)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path
