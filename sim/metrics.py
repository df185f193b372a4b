"""bench/metrics.py compute_metrics over numpy arrays, for runs of millions of tokens.

Same definitions, same order of values, the same numpy reductions and numpy's own
percentiles (engine/quantiles.py is numpy's linear method to the bit), so the result is
the BenchmarkMetrics compute_metrics gives on the same records -- a unit test holds
them equal -- in seconds instead of minutes for an hour of cluster traffic. The
short-TTFT-with-long overlap test is a sort + prefix maximum instead of a scan per pair.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bench.metrics import PERCENTILES, BenchmarkMetrics, Dist, jain_index
from bench.records import PHASES


@dataclass
class Timelines:
    """One entry per request, in record order; ``itl`` pools the gaps of successful ones."""

    send: np.ndarray
    first: np.ndarray  # first token time (nan: none)
    end: np.ndarray  # end time (nan: none)
    n_out: np.ndarray
    prompt_len: np.ndarray
    success: np.ndarray  # bool
    tenant: list[str]
    itl: np.ndarray
    phases: dict[str, np.ndarray]  # nan where unknown


def _dist(x: np.ndarray, percentiles: Sequence[float]) -> Dist:
    if not len(x):
        return Dist.of([], percentiles)
    vals = np.percentile(x, list(percentiles))
    pct = {float(p): float(v) for p, v in zip(percentiles, vals, strict=True)}
    med = pct[50.0] if 50.0 in pct else float(np.percentile(x, 50.0))
    return Dist(len(x), float(x.mean()), med, float(x.std()), pct)


def _short_with_long(send: np.ndarray, ttft: np.ndarray, e2el: np.ndarray, plen: np.ndarray,
                     threshold: int) -> np.ndarray:
    is_long = (plen > threshold) & (e2el != 0)
    if not is_long.any():
        return np.empty(0)
    ls, le = send[is_long], send[is_long] + e2el[is_long]
    order = np.argsort(ls, kind="stable")
    ls, prefmax = ls[order], np.maximum.accumulate(le[order])
    short = plen <= threshold
    s, t = send[short], ttft[short]
    idx = np.searchsorted(ls, s + t, side="left")  # longs that started before s + ttft
    hit = (idx > 0) & (prefmax[np.maximum(idx - 1, 0)] > s)
    return t[hit]


def fast_metrics(tl: Timelines, *, slos: Mapping[str, float] | None = None,
                 percentiles: Sequence[float] = PERCENTILES,
                 long_prompt_threshold: int | None = 1024,
                 tenant_weights: Mapping[str, float] | None = None) -> BenchmarkMetrics:
    """compute_metrics(records) without building the records (latency_alone: none)."""
    ok = tl.success & ~np.isnan(tl.first)
    send, first, n_out = tl.send[ok], tl.first[ok], tl.n_out[ok]
    last = np.where(np.isnan(tl.end), tl.first, tl.end)
    ends_all = tl.send + np.where(np.isnan(last), 0.0, last - tl.send)  # send + (e2el or 0)
    d = float(ends_all.max() - tl.send.min()) if len(tl.send) else 0.0
    if not d > 0:
        raise ValueError(f"duration_s must be > 0, got {d}")
    ttft = first - send
    e2el = last[ok] - send
    multi = n_out > 1
    tpot = (e2el[multi] - ttft[multi]) / (n_out[multi] - 1)
    plen = tl.prompt_len[ok]
    n_in, n_tot = int(plen.sum()), int(n_out.sum())
    weights = dict(tenant_weights or {})
    served = dict.fromkeys(weights, 0.0)
    for t, p, n in zip((x for x, k in zip(tl.tenant, ok, strict=True) if k), plen.tolist(),
                       n_out.tolist(), strict=True):
        served[t] = served.get(t, 0.0) + (p + n) / d
    per_weight = [v / weights.get(t, 1.0) for t, v in served.items()]
    phases = {p: tl.phases[p][ok] for p in PHASES}
    phases = {p: v[~np.isnan(v)] for p, v in phases.items()}
    short = (_short_with_long(send, ttft, e2el, plen, long_prompt_threshold)
             if long_prompt_threshold is not None else np.empty(0))
    goodput = None
    if slos:
        good = np.ones(len(ttft), dtype=bool)
        values = {"ttft": ttft, "e2el": e2el}
        for key, limit in slos.items():
            if key == "tpot":
                tp = np.full(len(ttft), np.nan)
                tp[multi] = tpot
                good &= np.isnan(tp) | (tp * 1e3 <= limit)
            else:
                good &= values[key] * 1e3 <= limit
        goodput = int(good.sum()) / d
    q = phases["queue"]
    return BenchmarkMetrics(
        completed=int(ok.sum()), failed=int(len(ok) - ok.sum()), duration_s=d,
        total_input_tokens=n_in, total_output_tokens=n_tot,
        request_throughput=int(ok.sum()) / d, output_throughput=n_tot / d,
        total_token_throughput=(n_in + n_tot) / d,
        ttft=_dist(ttft, percentiles), tpot=_dist(tpot, percentiles),
        itl=_dist(tl.itl, percentiles), e2el=_dist(e2el, percentiles),
        slos=dict(slos or {}), request_goodput=goodput,
        phases={p: _dist(v, percentiles) for p, v in phases.items() if len(v)},
        jain_slowdown=None, jain_tenant=jain_index(per_weight) if per_weight else None,
        tenant_throughput=served, max_queue_wait_s=float(q.max()) if len(q) else None,
        short_ttft_with_long=_dist(short, percentiles) if len(short) else None)
