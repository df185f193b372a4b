"""Serving metrics computed like ``vllm bench serve``, plus fairness (Jain's index).

Per request: TTFT = first token - send; E2EL = end (or last token) - send;
TPOT = (E2EL - TTFT) / (n_out - 1), excluding the first token (undefined for n_out <= 1);
ITL = gaps between consecutive token arrivals. Aggregates: mean, median, std and
percentiles (``engine.quantiles``: numpy's linear interpolation) over successful requests; ITL
pools every gap of every request. Goodput = requests meeting every given SLO / duration.

Records (what a client saw of each request) are :class:`bench.records.RequestRecord`.

    m = compute_metrics(records, duration_s, slos=parse_slo("ttft:500,tpot:50"))
    print(m.format()); json.dump(m.to_json_dict(), f)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.records import PHASES, TTFT_PHASES, RequestRecord
from cluster.config.serve import slo_pairs
from engine.quantiles import median
from engine.quantiles import percentiles as percentiles_of

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)


@dataclass(frozen=True)
class Dist:
    """Summary of a sample in seconds; an empty sample reports zeros (as vLLM)."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> Dist:
        x = np.asarray(values if len(values) else [0.0], dtype=float)
        pct = percentiles_of(x.tolist(), percentiles)
        med = pct[50.0] if 50.0 in pct else median(x.tolist())
        return cls(len(values), float(x.mean()), med, float(x.std()), pct)


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` -> ms per key (the rule: cluster/config/serve.py slo_pairs)."""
    return dict(slo_pairs(text))


def meets_slos(r: RequestRecord, slos: Mapping[str, float]) -> bool:
    """All given SLOs (ms) hold; an undefined TPOT (n_out <= 1) meets any TPOT SLO."""
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(
        (v := values[key]) is not None and v * 1e3 <= limit_ms or (v is None and key == "tpot")
        for key, limit_ms in slos.items()
    )


def jain_index(values: Iterable[float]) -> float:
    """(sum x)^2 / (n * sum x^2): 1.0 when all equal, 1/n when one takes everything."""
    x = np.asarray(list(values), dtype=float)
    if x.size == 0 or np.any(x < 0):
        raise ValueError("jain_index needs a non-empty sample of values >= 0")
    sq = float(np.sum(x * x))
    return 1.0 if sq == 0 else float(np.sum(x) ** 2 / (x.size * sq))


AloneFn = Mapping[str, float] | Callable[[RequestRecord], float]


def slowdowns(records: Iterable[RequestRecord], alone: AloneFn | None = None) -> list[float]:
    """E2EL / latency-alone per request that has both (``alone``: map by id, or function)."""
    out = []
    for r in records:
        get = alone.get if isinstance(alone, Mapping) else None
        base = get(r.request_id) if get else alone(r) if alone else r.latency_alone_s
        if base is None or r.e2el is None:
            continue
        if not base > 0:
            raise ValueError(f"latency-alone of {r.request_id} must be > 0, got {base}")
        out.append(r.e2el / base)
    return out


def _short_ttfts_with_long(ok: list[RequestRecord], threshold: int) -> list[float]:
    """TTFTs of prompts <= threshold whose wait overlapped a longer prompt's lifetime."""
    longs = [(r.send_time, r.send_time + r.e2el) for r in ok if r.prompt_len > threshold and r.e2el]
    if not longs:
        return []
    ls, le = np.array(longs).T  # lifetimes of long prompts
    return [
        r.ttft
        for r in ok
        if r.prompt_len <= threshold
        and r.ttft is not None
        and np.any((ls < r.send_time + r.ttft) & (le > r.send_time))
    ]


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Aggregates of one run (latencies in seconds; printed and serialised in ms)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2el: Dist
    slos: dict[str, float] = field(default_factory=dict)
    request_goodput: float | None = None
    phases: dict[str, Dist] = field(default_factory=dict)
    jain_slowdown: float | None = None
    jain_tenant: float | None = None
    tenant_throughput: dict[str, float] = field(default_factory=dict)
    max_queue_wait_s: float | None = None
    short_ttft_with_long: Dist | None = None
    # tenant -> TTFT phase (bench.records.TTFT_PHASES) -> its distribution; "all" first
    ttft_phases: dict[str, dict[str, Dist]] = field(default_factory=dict)
    # tenant -> (TTFT p50, phase -> seconds): the TTFT p50 split (median_split)
    ttft_p50_split: dict[str, tuple[float, dict[str, float]]] = field(default_factory=dict)

    def _scalars(self) -> list[tuple[str, str, object]]:
        """(json key, printed label, value) of the headline and fairness numbers."""
        q = self.max_queue_wait_s
        return [
            ("completed", "Successful requests:", self.completed),
            ("failed", "Failed requests:", self.failed),
            ("duration", "Benchmark duration (s):", self.duration_s),
            ("total_input_tokens", "Total input tokens:", self.total_input_tokens),
            ("total_output_tokens", "Total generated tokens:", self.total_output_tokens),
            ("request_throughput", "Request throughput (req/s):", self.request_throughput),
            ("request_goodput", "Request goodput (req/s):", self.request_goodput),
            ("output_throughput", "Output token throughput (tok/s):", self.output_throughput),
            (
                "total_token_throughput",
                "Total Token throughput (tok/s):",
                self.total_token_throughput,
            ),  # fmt: skip
            ("jain_slowdown", "Jain index (slowdown):", self.jain_slowdown),
            ("jain_tenant", "Jain index (tenant tput / weight):", self.jain_tenant),
            ("max_queue_wait_ms", "Max queue wait (ms):", None if q is None else q * 1e3),
        ]

    def _dists(self) -> list[tuple[str, str, str, Dist]]:
        """(json name, printed name, section header, Dist) in vLLM's order."""
        out = [
            ("ttft", "TTFT", "Time to First Token", self.ttft),
            ("tpot", "TPOT", "Time per Output Token (excl. 1st token)", self.tpot),
            ("itl", "ITL", "Inter-token Latency", self.itl),
            ("e2el", "E2EL", "End-to-end Latency", self.e2el),
        ]
        out += [(k, k, f"Server {k} time", d) for k, d in self.phases.items()]
        if (d := self.short_ttft_with_long) is not None:
            out.append(("short_ttft_with_long", "short TTFT", f"Short TTFT w/ long (n={d.count})", d))  # fmt: skip
        return out

    def to_json_dict(self) -> dict[str, object]:
        """Flat dict with ``vllm bench serve`` key names (``mean_ttft_ms``, ``p99_itl_ms``...)."""
        out: dict[str, object] = {key: v for key, _, v in self._scalars()}
        out.update(slos_ms=dict(self.slos), tenant_throughput=dict(self.tenant_throughput))
        for name, _, _, d in self._dists():
            out[f"mean_{name}_ms"], out[f"median_{name}_ms"] = d.mean * 1e3, d.median * 1e3
            out[f"std_{name}_ms"], out[f"count_{name}"] = d.std * 1e3, d.count
            out.update({f"p{_pname(p)}_{name}_ms": v * 1e3 for p, v in d.percentiles.items()})
        if self.ttft_phases:
            out["ttft_phases_ms"] = {
                tenant: {ph: {"mean": d.mean * 1e3, "median": d.median * 1e3,
                              **{f"p{_pname(p)}": v * 1e3 for p, v in d.percentiles.items()}}
                         for ph, d in phases.items()}
                for tenant, phases in self.ttft_phases.items()}
            out["ttft_phase_sum_over_ttft_p50"] = self.phase_sum_ratio()
        if self.ttft_p50_split:
            out["ttft_p50_phases_ms"] = {
                tenant: {"ttft_p50": p50 * 1e3, **{ph: v * 1e3 for ph, v in parts.items()}}
                for tenant, (p50, parts) in self.ttft_p50_split.items()}
        return out

    def phase_sum_ratio(self) -> float | None:
        """The phases' p50s summed over the TTFT p50 (all tenants): how well the medians
        of the parts describe the median of the whole (1.0 when one request dominates)."""
        phases = self.ttft_phases.get("all")
        if not phases or not self.ttft.median > 0:
            return None
        return sum(d.median for d in phases.values()) / self.ttft.median

    def format_ttft_phases(self) -> list[str]:
        """The TTFT phase table: p50 / p99 (ms) per phase, one row per tenant."""
        if not self.ttft_phases:
            return []
        names = list(next(iter(self.ttft_phases.values())))
        width = max(12, *(len(n) + 1 for n in names))
        lines = [f"{'TTFT by phase, p50 / p99 (ms)':-^50}",
                 "tenant".ljust(10) + "".join(n.rjust(width) for n in names) + "  n".rjust(6)]
        for tenant, phases in self.ttft_phases.items():
            cells = "".join(f"{d.median * 1e3:.1f}/{d.percentiles.get(99.0, d.median) * 1e3:.1f}"
                            .rjust(width) for d in phases.values())
            count = next(iter(phases.values())).count
            lines.append(tenant[:10].ljust(10) + cells + str(count).rjust(6))
        if (ratio := self.phase_sum_ratio()) is not None:
            lines.append(f"{'Phase p50s summed / TTFT p50:':<40} {ratio:<10.2f}")
        if self.ttft_p50_split:  # the parts of the median TTFT itself: they add up to it
            lines.append(f"{f'TTFT p50 by phase (ms; the {MEDIAN_SHARE:.0%} nearest it)':-^50}")
            lines.append("tenant".ljust(10) + "".join(n.rjust(width) for n in names)
                         + "sum".rjust(8) + "TTFT p50".rjust(10))
            for tenant, (p50, parts) in self.ttft_p50_split.items():
                lines.append(tenant[:10].ljust(10) + "".join(
                    f"{parts[n] * 1e3:.1f}".rjust(width) for n in names)
                    + f"{sum(parts.values()) * 1e3:.1f}".rjust(8) + f"{p50 * 1e3:.1f}".rjust(10))
        return lines

    def format(self, title: str = "Serving Benchmark Result") -> str:
        """The ``vllm bench serve`` result block, followed by fairness lines."""
        lines = [f"{' ' + title + ' ':=^50}"]

        def row(label: str, value: object) -> None:
            fmt = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
            lines.append(fmt.format(label, value))

        scalars = self._scalars()
        for _, label, v in scalars[:-3]:
            if v is not None:  # goodput only with SLOs
                row(label, v)
        for _, short, header, d in self._dists():
            lines.append(f"{header:-^50}")
            row(f"Mean {short} (ms):", d.mean * 1e3)
            row(f"Median {short} (ms):", d.median * 1e3)
            for p, v in d.percentiles.items():
                if p != 50:
                    row(f"P{_pname(p)} {short} (ms):", v * 1e3)
        lines += self.format_ttft_phases()
        lines.append(f"{'Fairness':-^50}")
        for _, label, v in scalars[-3:]:
            row(label, "n/a" if v is None else float(v))  # type: ignore[arg-type]
        lines.append("=" * 50)
        return "\n".join(lines)


MEDIAN_SHARE = 0.1  # the share of requests, nearest the TTFT p50, that split it


def median_split(rows: Sequence[tuple[float, Mapping[str, float]]]
                 ) -> tuple[float, dict[str, float]] | None:
    """The TTFT p50 split into phases: (p50, each phase's mean over the MEDIAN_SHARE of
    requests whose TTFT is nearest the p50, at least one). Per request the phases add up
    to its TTFT (cluster/ttft_phases.py), so these add up to those requests' mean TTFT,
    the p50 give or take their spread; the phases' own p50s need not add up to the
    TTFT's (each may come from a different request)."""
    if not rows:
        return None
    p50 = median([t for t, _ in rows])
    k = max(1, round(MEDIAN_SHARE * len(rows)))
    near = [p for _, p in sorted(rows, key=lambda r: abs(r[0] - p50))[:k]]
    return p50, {ph: sum(p[ph] for p in near) / k for ph in near[0]}


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    *,
    slos: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
    long_prompt_threshold: int | None = 1024,
    latency_alone: AloneFn | None = None,
    tenant_weights: Mapping[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate records of one run; ``duration_s`` defaults to first send .. last end.

    Tenant fairness: Jain over (prompt + output tokens served / duration / weight) of
    every tenant in ``tenant_weights`` (weight 1 for unlisted tenants that appear).
    """
    ok = [r for r in records if r.success and r.ttft is not None]
    d = duration_s
    if d is None:
        ends = [r.send_time + (r.e2el or 0.0) for r in records]
        d = max(ends) - min(r.send_time for r in records) if records else 0.0
    if not d > 0:
        raise ValueError(f"duration_s must be > 0, got {d}")
    dist = lambda xs: Dist.of(xs, percentiles)  # noqa: E731
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.n_out for r in ok)
    weights = dict(tenant_weights or {})
    served = dict.fromkeys(weights, 0.0)
    for r in ok:
        served[r.tenant] = served.get(r.tenant, 0.0) + (r.prompt_len + r.n_out) / d
    per_weight = [v / weights.get(t, 1.0) for t, v in served.items()]
    slow = slowdowns(ok, latency_alone)
    phases = {p: [v for r in ok if (v := getattr(r, f"{p}_s")) is not None] for p in PHASES}
    # tenant ("all" first) -> (TTFT, its phases) of each request the server split
    by_tenant: dict[str, list[tuple[float, dict[str, float]]]] = {}
    for r in ok:
        if (parts := r.ttft_phases()) is not None:
            by_tenant.setdefault("all", []).append((r.ttft, parts))
            by_tenant.setdefault(r.tenant, []).append((r.ttft, parts))
    if len(by_tenant) == 2:  # one tenant: its row is the "all" row
        by_tenant = {"all": by_tenant["all"]}
    thr = long_prompt_threshold
    short = _short_ttfts_with_long(ok, thr) if thr is not None else []
    # fmt: off
    return BenchmarkMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration_s=float(d),
        total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(ok) / d, output_throughput=n_out / d,
        total_token_throughput=(n_in + n_out) / d,
        ttft=dist([r.ttft for r in ok]),
        tpot=dist([r.tpot for r in ok if r.tpot is not None]),
        itl=dist([g for r in ok for g in r.itls]),  # pooled over all requests
        e2el=dist([r.e2el for r in ok]),
        slos=dict(slos or {}),
        request_goodput=sum(meets_slos(r, slos) for r in ok) / d if slos else None,
        phases={p: dist(vs) for p, vs in phases.items() if vs},
        jain_slowdown=jain_index(slow) if slow else None,
        jain_tenant=jain_index(per_weight) if per_weight else None,
        tenant_throughput=served,
        max_queue_wait_s=max(phases["queue"], default=None),
        short_ttft_with_long=dist(short) if short else None,
        ttft_phases={t: {ph: dist([p[ph] for _, p in rows]) for ph in TTFT_PHASES}
                     for t, rows in by_tenant.items()},
        ttft_p50_split={t: sp for t, rows in by_tenant.items() if (sp := median_split(rows))},
    )
    # fmt: on
