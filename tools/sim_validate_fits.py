"""Per-step fits of a real run for tools/sim_validate.py: each role's step under this
load as ``scale * calibrated compute + offset`` (tools/sim_scaled.py StepFit), from the
workers' trace spans.

Prefill: a step's traced span (the model's forward and sampling, prefill_worker/engine.py)
against the calibrated compute of its chunks; what the step spends after the span (KV
export, sends) is the mean step (worker stats) less the mean span, less the simulator's
own export and sampling (what it spends before the span is the dispatch's: a request's
dispatch is timed to its first span's start). Decode: the period from one step's start to the next while a
leg runs in both (the loop steps back to back then, so its work between steps counts)
against the calibrated step of that batch, less the sampling the simulator adds; the
overhead is then in the offset.

Why an offset: the real prefill step spends ~1.3-1.6 ms beyond its calibrated compute
at every chunk size here (36 to 256 tokens, context 0 to 1024), so one factor per role
(the mean step's ratio) made short prompts' steps 2x too fast and TTFT p50 ~20% low.
A step that runs a request's first chunk costs more (``join_s``, fitted beside the line:
0.2-0.35 ms here, the arrival's dispatch and reserve run beside it). Without it the
64-token rows' slope was rejected in 7 of 8 fits over four validations (scale 1: their
long prompts came out 6-15% slow at TTFT p99); with it a recorded row's was kept (0.32).

Each step is the typical one plus a draw of the real steps' residuals: the line is moved
to the residuals' median and the residuals (median 0) are drawn per simulated step, so a
short prompt's one or two steps are typical ones (its TTFT is a p50) and a long prompt's
twenty keep the mean (its TTFT is a p99). Drawn around the least-squares line instead
(mean 0), the skewed residuals lowered the typical step and TTFT p50 fell 5-20% (an
earlier session). On five recorded rows, against the run they were fitted to, TTFT p50
errors went from 26/1/3/6/5% to 11/6/0/5/8%, p99 from 0/11/5/0/2% to 1/3/10/3/4%. A
decode step's spread is drawn around the median the same way: the decode worker's stalls
(here ~0.5% of steady periods over 3 ms, one of 22 ms) are a share of the real ITL p99.

The under-load terms tools/sim_validate.py fits to a row's real runs against their
simulated twins: the contention factors (per role and for the control plane), the KV
handoff (its mean, or each leg's unexplained part), each request's unexplained dispatch
and first-token delivery, the link factor and the stalls' scale found by bisection over
simulated runs, and the token delivery refitted to the traces.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from tools.sim_validate_report import by_request, control_terms

MIN_STEPS = 5
SLOPE = (0.2, 2.0)  # a least-squares slope outside this is the fit's conditioning, not load
SLOPE_SE = 3.0  # ... as is one within fewer standard errors of 0


def _fit(pred: list[float], real: list[float], median: bool = False,
         first: list[bool] | None = None) -> tuple[float, float, float] | None:
    """``real = scale * pred + offset (+ join where first)``, as (scale, offset, join):
    ``first`` marks the steps with a request's first chunk (their excess is only fitted
    with at least MIN_STEPS of each kind). With ``median`` (decode) the scale is 1 and the
    offset the median difference: the typical step, as a decode token's gap is one period,
    not the mean skewed by the machine's stalls; and a decode run's batches span too narrow
    a range of calibrated compute to fit a slope (least squares gave slopes of 1.1-4.1
    over one validation). Otherwise (prefill: a long prompt's TTFT sums its chunks) least
    squares, unless its slope leaves ``SLOPE`` or lies within ``SLOPE_SE`` standard errors
    of 0 (the steps do not pin it down), then scale 1 and the mean difference. 64-token
    chunks under load here gave 0.40-0.49 (SE ~0.1) in three runs: a floor of 0.5 made
    scale 1, so short-context chunks came out short and long-context ones long (TTFT p50
    -13 to -16%, p99 +5 to +11% on those rows). None with too few steps."""
    if len(pred) < MIN_STEPS:
        return None
    x, y = np.asarray(pred), np.asarray(real)
    if median:
        return 1.0, max(float(np.median(y - x)), 0.0), 0.0
    f = np.zeros(len(x)) if first is None else np.asarray(first, dtype=float)
    if not MIN_STEPS <= f.sum() <= len(f) - MIN_STEPS:
        f = np.zeros(len(x))  # too few of either kind to tell them apart
    a = np.column_stack([x, np.ones(len(x))] + ([f] if f.any() else []))
    k = a.shape[1]
    if np.ptp(x) > 0 and len(x) > k and np.linalg.matrix_rank(a) == k:
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        resid = y - a @ coef
        se = float(np.sqrt(resid @ resid / (len(x) - k) * np.linalg.inv(a.T @ a)[0, 0]))
        scale, offset = float(coef[0]), float(coef[1])
        if SLOPE[0] <= scale <= SLOPE[1] and offset >= 0 and scale >= SLOPE_SE * se:
            return scale, offset, max(float(coef[2]), 0.0) if k > 2 else 0.0
    d = y - x  # scale 1: each kind's mean difference
    rest = float(np.mean(d[f == 0]))
    return 1.0, max(rest, 0.0), max(float(np.mean(d[f == 1])) - rest, 0.0) if f.any() else 0.0


def _steps(events, phase: str) -> dict[tuple[str, float, float], list]:
    out: dict[tuple[str, float, float], list] = defaultdict(list)
    for e in events:
        if e.phase == phase:
            out[(e.worker, e.start, e.end)].append(e)
    return out


def prefill_fit(real, base, extras):
    from bench.studies.service import mean_step_s
    from tools.sim_scaled import StepFit, runs_first_chunk

    prompt = {r.request_id: r.prompt_len for r in real.records}
    pred, span, post, first = [], [], [], []
    by_worker: dict[str, list] = defaultdict(list)  # (start, end, legs, later chunk, post)
    # in the order they ran, per worker: the residuals are drawn in runs of that order
    for (worker, start, end), evs in sorted(_steps(real.events, "prefill_chunk").items(),
                                            key=lambda kv: kv[0][:2]):
        chunks = [(e.scheduled_tokens, e.past_kv_tokens) for e in evs]
        pred.append(base.prefill_s(chunks))
        span.append(end - start)
        first.append(runs_first_chunk(chunks))
        finals = sum(e.token_end >= prompt.get(e.request_id.split("#")[0], 1 << 30)
                     for e in evs)
        post.append(sum(extras.kv_export_s(c) for c, _ in chunks)
                    + (extras.sample_s(finals) if finals else 0.0))
        by_worker[worker].append((start, end, {e.request_id for e in evs}, not first[-1],
                                  post[-1]))
    fit, mean = _fit(pred, span, first=first), mean_step_s(real.worker_stats, "prefill")
    if fit is None or mean is None:
        return None
    scale, offset, join = fit
    # the line is the steps' mean; a step is the line's median plus a drawn residual, so
    # a short prompt's few steps are typical ones and a long prompt's sum keeps the mean
    x, y, f = np.asarray(pred), np.asarray(span), np.asarray(first, dtype=float)
    resid = y - (scale * x + offset + join * f)
    mid = float(np.median(resid))
    overhead = max(mean - float(np.mean(span)) - float(np.mean(post)), 0.0)
    # each kind draws its own residuals where the first-chunk term was fitted apart
    apart = MIN_STEPS <= f.sum() <= len(f) - MIN_STEPS
    d = resid - mid
    # (a first chunk's wait before its span is not added: the simulated dispatch is scaled
    # so its median is the real dispatch to the span's start, tools/sim_validate_fits.py
    # contention, and each request draws what the real one took beyond it,
    # arrival_residuals; added to the step too it counted twice)
    return StepFit(scale, max(offset + mid, 0.0), overhead,
                   join, tuple((d[f == 0] if apart else d).tolist()),
                   tuple(d[f == 1].tolist()) if apart else (), _between(by_worker, overhead))


def _between(by_worker: dict[str, list], overhead: float) -> float:
    """What the real loop spends between a step and the next one that carries on a
    request of it (so ran at once) before that step's span -- the loop's turn, its
    commands and I/O, ``schedule()`` -- beyond what the simulated step has after its
    span (the previous step's export and sampling, and ``overhead``): the median over
    such pairs. The worker's step time starts after ``schedule()``, so the fitted overhead
    leaves it out; a long prompt's chunks each pay it. 0 with too few pairs."""
    gaps = []
    for steps in by_worker.values():
        steps.sort(key=lambda s: s[0])
        for (_, end, legs, _, post), (start, _, after, later, _) in zip(steps, steps[1:],
                                                                      strict=False):
            if later and legs & after:
                gaps.append(start - end - post)
    if len(gaps) < MIN_STEPS:
        return 0.0
    return max(float(np.median(gaps)) - overhead, 0.0)


def decode_fit(real, base, extras):
    """The decode step: the calibrated step plus the median excess of the real steady
    periods (start to next start while a leg runs on, less the sampling the simulator
    adds), their spread around it, and what a step that legs join adds (``_join``)."""
    from tools.sim_scaled import StepFit

    by_worker: dict[str, list] = defaultdict(list)
    for (worker, start, end), evs in _steps(real.events, "decode_step").items():
        by_worker[worker].append((start, end, [e.past_kv_tokens or 0 for e in evs],
                                  {e.request_id for e in evs}))
    pred, period = [], []
    for steps in by_worker.values():
        steps.sort(key=lambda s: s[0])
        for (s0, _, past, legs), joined, (s1, _, _, after) in zip(
                steps, _joined(steps), steps[1:], strict=False):
            # a join is its own term; nobody ran on: the loop may have napped in between
            if joined or not legs & after:
                continue
            b = len(past)
            run = base.decode_run_s(b, sum(past) + b, max(past) + 1, 1)
            pred.append(float(np.asarray(run)[0]))
            period.append(s1 - s0 - extras.sample_s(b))
    fit = _fit(pred, period, median=True)
    if fit is None:
        return None
    spread = np.asarray(period) - np.asarray(pred) - fit[1]
    return StepFit(fit[0], fit[1], 0.0, _join(by_worker), tuple(spread.tolist()))


def _joined(steps: list) -> list[bool]:
    """Per step of one worker (sorted by start): did a leg join it (not in the step before)?"""
    before: set = set()
    out = []
    for *_, legs in steps:
        out.append(bool(legs - before))
        before = legs
    return out


def _join(by_worker: dict[str, list]) -> float:
    """What a step that legs join costs more: the median, over such steps, of the span
    beyond the median span of steps of the same batch that no leg joined (on the tiny
    model here ~0.6 ms at batch 1 against a 0.3 ms step: the worker waited for the KV).
    0 with too few such steps."""
    steady: dict[int, list[float]] = defaultdict(list)
    joins: list[tuple[int, float]] = []
    for steps in by_worker.values():  # (start, end, past, legs), sorted by start
        for (start, end, _, legs), joined in zip(steps, _joined(steps), strict=True):
            if joined:
                joins.append((len(legs), end - start))
            else:
                steady[len(legs)].append(end - start)
    typical = {b: float(np.median(v)) for b, v in steady.items() if len(v) >= MIN_STEPS}
    excess = [span - typical[b] for b, span in joins if b in typical]
    return max(float(np.median(excess)), 0.0) if len(excess) >= MIN_STEPS else 0.0


def step_fits(real, base, extras) -> dict:
    """{role: StepFit} for the roles with enough traced steps in ``real``: compute against
    ``base`` (the calibration), less the sampling and KV export ``extras`` (the cost model
    the simulator will run with) adds."""
    fits = {"prefill": prefill_fit(real, base, extras),
            "decode": decode_fit(real, base, extras)}
    return {r: f for r, f in fits.items() if f is not None}


def contention(real, sim) -> dict[str, float]:
    """Per role: the real workers' mean step time over the simulator's on the same run;
    for the control plane: the real median dispatch latency over the simulated one."""
    from bench.studies.service import mean_step_s

    out = {}
    for role in ("prefill", "decode"):
        a, b = mean_step_s(real.worker_stats, role), mean_step_s(sim.worker_stats, role)
        out[role] = a / b if a and b else 1.0
    a, b = control_terms(real)["dispatch p50"], control_terms(sim)["dispatch p50"]
    out["control"] = a / b if a and b and a > 0 and b > 0 else 1.0
    return out


def _after_compute(costs):
    """What the simulator counts in a final prefill step after its compute (sampling, the
    KV export, the step overhead): subtracted from trace-measured delays on both sides."""
    return lambda r: (costs.sample_s(1) + costs.kv_export_s(r.prompt_len)
                      + costs.step_overhead_s("prefill", 1))


def handoff_mean(out) -> float | None:
    """Mean KV handoff of a traced run: a leg's last chunk computed -> its decode worker
    admits it (the post-compute work, the final frames' transfer, the decode worker
    taking them at its next step)."""
    from sim.measure_control import samples

    h = samples(out, lambda r: 0.0)[2]
    return float(np.mean(list(h.values()))) if h else None


def handoff_residuals(real, sim) -> list[float]:
    """Each leg's KV handoff (its last chunk computed -> its decode worker admits it) in
    the traced ``real`` run less the same leg's in ``sim`` (the same workload simulated
    at the idle link): what the model leaves out of that leg's handoff under this load.
    The handoffs are ``handoff_mean``'s (sim/measure_control.py ``samples``)."""
    from sim.measure_control import samples

    r, s = samples(real, lambda _: 0.0)[2], samples(sim, lambda _: 0.0)[2]
    return [r[k] - s[k] for k in sorted(r) if k in s]


def arrivals(out, after_compute: Callable[[Any], float]) -> dict[str, tuple[float, float]]:
    """Per request of a traced run with its first token: its dispatch (send -> its first
    chunk's start) and its first token's delay after its last chunk's compute, less
    ``after_compute(record)`` (the work the simulator counts in that step after it)."""
    ev, off, out_ = by_request(out.events), out.wall_offset, {}
    for r in out.records:
        chunks = sorted(ev.get(r.request_id, {}).get("prefill_chunk", []), key=lambda x: x.start)
        if r.success and chunks and r.token_times:
            out_[r.request_id] = (chunks[0].start - (r.send_time + off),
                                  r.token_times[0] + off - chunks[-1].end - after_compute(r))
    return out_


def arrival_residuals(real, sim, costs) -> list[tuple[float, float]]:
    """Per request of the traced ``real`` run also in ``sim`` (the same workload simulated
    with the fitted terms, ``costs``): its dispatch less the simulated one (the waits both
    model cancel), and its first token's delay after its last chunk less the modelled
    delivery (``costs.delivery.first_token_s``; the simulated step's drawn spread lies
    after its traced compute, so the simulated delay would carry a second draw)."""
    after = _after_compute(costs)
    r, s = arrivals(real, after), arrivals(sim, after)
    first = costs.delivery.first_token_s
    return [(r[k][0] - s[k][0], r[k][1] - first) for k in sorted(r) if k in s]


def _bisect(gap: Callable[[float], float], lo: float, hi: float, iters: int) -> float:
    """The f in [lo, hi] where the increasing ``gap(f)`` crosses 0, by bisection on log f."""
    if gap(lo) >= 0:
        return lo
    if gap(hi) <= 0:
        return hi
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def fit_link_factor(target: float | None, simulate: Callable[[float], Any],
                    lo: float = 0.25, hi: float = 256.0, iters: int = 14) -> float:
    """The factor on the KV link's write time (latency and seconds per byte) that makes the
    simulated mean handoff equal ``target``, the real one under this load: the connector's
    threads, the receiver and the decode loop share the machine, which slows the handoff
    beyond the idle link's figures. ``simulate(f)`` runs the simulator with the link scaled
    by ``f``; the handoff grows with ``f``, so a bisection on log f finds it."""
    if target is None:
        return 1.0

    def gap(f: float) -> float:
        h = handoff_mean(simulate(f))
        return (h if h is not None else 0.0) - target

    return _bisect(gap, lo, hi, iters)


def fit_stall_scale(target: float | None, simulate: Callable[[float], Any],
                    lo: float = 0.25, hi: float = 4.0, iters: int = 10) -> float:
    """The factor on the delivery's stalls that makes the simulated ITL p99 (the median of
    the seeded runs ``simulate(f)`` gives) the real one (``target``). The stalls' size fitted on the real step ends (``fit_delivery``) sets
    the real ITL p99 there, but in the simulator the stalls meet simulated steps, whose
    own tail is narrower; so the stall term is taken end to end, as the link's is. A
    target that even ``hi`` times the stalls cannot reach is not the stalls' (the paced
    rows' ITL p99 is the KV pacing's first gap, 36-55 ms): then 1, as fitted (scaled to
    13-24 ms there, the stalls coalesced nearly every token: ITL p50 0). ``simulate(f)``
    runs the simulator with the stalls scaled by ``f``, once per seed."""
    from bench.metrics import compute_metrics

    if target is None:
        return 1.0

    def gap(f: float) -> float:
        p99s = [compute_metrics(run.records).itl.percentiles[99.0] for run in simulate(f)]
        p99s = [p for p in p99s if p is not None]
        return (float(np.median(p99s)) if p99s else 0.0) - target

    if gap(hi) < 0:
        return 1.0
    return _bisect(gap, lo, hi, iters)


def delivery_under_load(real, costs):
    """The delivery model (first token, token delays and their coalescing, stalls) fitted
    to a loaded run's traces, instead of the idle service's: (Delivery, fit error s) or
    None when too few requests had complete traces."""
    from sim.measure_control import fit_streams, samples

    _, first, _, streams = samples(real, _after_compute(costs))
    if len(first) < 2 or len(streams) < 2:
        return None
    return fit_streams(first, streams, costs)
