"""Per-step fits of a real run for tools/sim_validate.py: each role's step under this
load as ``scale * calibrated compute + offset`` (sim/scaled.py StepFit), from the
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
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

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
    from sim.scaled import StepFit, runs_first_chunk

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
    # so its median is the real dispatch to the span's start, tools/sim_validate_terms.py
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
    from sim.scaled import StepFit

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
