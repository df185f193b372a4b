"""One configuration's run: its records, metrics and trace events, and the figures the
study tables take from them (percentiles in ms, step times, the JSON detail).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from bench.metrics import BenchmarkMetrics, compute_metrics
from bench.records import RequestRecord
from bench.studies.service import DISAGG, Layout, RunOutput, mean_step_s
from engine.quantiles import percentile
from engine.tracing import TraceEvent

if TYPE_CHECKING:
    from cluster.config.serve import ServeConfig


@dataclass
class ConfigRun:
    """One configuration's records, metrics, trace events and files."""

    name: str
    cfg: ServeConfig
    layout: Layout
    output: RunOutput
    slos: dict[str, float] = field(default_factory=dict)
    long_prompt_threshold: int | None = 512
    latency_alone: Callable[[RequestRecord], float] | None = None
    files: dict[str, str] = field(default_factory=dict)

    @property
    def records(self) -> list[RequestRecord]:
        return self.output.records

    @property
    def events(self) -> list[TraceEvent]:
        return self.output.events

    @cached_property
    def metrics(self) -> BenchmarkMetrics:
        return compute_metrics(self.records, slos=self.slos,
                               long_prompt_threshold=self.long_prompt_threshold,
                               latency_alone=self.latency_alone,
                               tenant_weights=dict(self.cfg.scheduler.tenant_weights or {}))

    def knobs(self, base: ServeConfig) -> dict[str, Any]:
        """Dotted keys where this configuration differs from ``base``."""
        a, b = self.cfg.to_dict(), base.to_dict()
        out = {f"{s}.{k}": v for s, sec in a.items() for k, v in sec.items()
               if b.get(s, {}).get(k) != v}
        if self.layout != DISAGG:
            out["layout"] = dict(self.layout.__dict__)
        return out


def config_detail(run: ConfigRun, base: ServeConfig, **extra: Any) -> dict[str, Any]:
    """The JSON detail of one configuration: knobs, full metrics, files, anything else."""
    return {"knobs": run.knobs(base), "layout": dict(run.layout.__dict__),
            "metrics": run.metrics.to_json_dict(), "worker_stats": run.output.worker_stats,
            "files": dict(run.files), **extra}


def p(metrics: BenchmarkMetrics, dist: str, pct: float = 99.0) -> float:
    """A percentile of a metrics Dist, in ms."""
    return getattr(metrics, dist).percentiles[pct] * 1e3


def pct_ms(values: Sequence[float], pct: float = 99.0) -> float | None:
    """A percentile of seconds, in ms (None for no values)."""
    return percentile(values, pct) * 1e3 if len(values) else None


def step_ms(run: ConfigRun, role: str) -> float | None:
    """Mean step time (ms) of the ``role`` workers during the run (worker statistics)."""
    v = mean_step_s(run.output.worker_stats, role)
    return None if v is None else v * 1e3
