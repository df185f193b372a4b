"""The steps' spread is drawn in runs of the real steps' own order (tools/sim_scaled.py
``SPREAD_BLOCK``): consecutive real chunks of a long prompt were alike, so the simulated
ones must be too, or the prompt's sum varies too little and its TTFT p99 comes out low."""

from __future__ import annotations

import numpy as np

from bench.studies.service import RunOutput
from engine.tracing import TraceEvent
from tests.step_runs import MS
from tests.step_runs import linear_costs as _base
from tools.sim_scaled import SPREAD_BLOCK, SPREAD_DRAWS, ScaledCosts, StepFit, _Draws
from tools.sim_validate_fits import prefill_fit


def test_the_draws_follow_the_spreads_order_in_blocks_from_seeded_starts() -> None:
    spread = np.arange(100, dtype=float)
    d = _Draws(spread, 3)
    stream = d.take(SPREAD_DRAWS)
    assert set(stream) <= set(spread)
    steps = np.diff(stream)[: 40 * SPREAD_BLOCK].reshape(40, SPREAD_BLOCK)
    # within a block each draw is the next residual (wrapping at the end of the spread)
    assert np.all(np.isin(steps[:, : SPREAD_BLOCK - 1], (1.0, -99.0)))
    assert len({tuple(stream[:SPREAD_BLOCK])} | {tuple(_Draws(spread, 4).take(SPREAD_BLOCK))}) == 2
    assert np.array_equal(_Draws(spread, 3).take(500), stream[:500])  # a seed repeats
    # every residual is drawn about as often (the wrap keeps the ends from being rarer)
    counts = np.bincount(stream.astype(int), minlength=100)
    assert counts.min() > 0.6 * counts.mean() and counts.max() < 1.6 * counts.mean()


def test_a_block_of_one_is_independent_draws() -> None:
    stream = _Draws(np.arange(1000, dtype=float), 0, block=1).take(5000)
    assert np.mean(np.diff(stream) == 1.0) < 0.01


def _prompts(base, order: list[int]) -> RunOutput:
    """Long prompts of 8 chunks each whose later chunks are all slow or all fast by prompt
    (the host slow for a prompt's tens of ms), the events listed in ``order``."""
    events, t = [], 0.0
    for r in range(12):
        slow = 2 * MS if r % 2 else 0.0
        for k in range(8):
            c, p = 128, 128 * k
            span = base.prefill_s([(c, p)]) + 1 * MS + (slow if k else 0.0)
            events.append(TraceEvent(f"r{r}#x#1", "prefill_chunk", "prefill-0", t,
                                     t + span, scheduled_tokens=c, past_kv_tokens=p,
                                     token_start=p, token_end=p + c))
            t += span
        t += 0.05
    events = [events[i] for i in order]
    return RunOutput([], events, {"prefill-0": {"role": "prefill", "steps": len(events),
                                                "mean_step_s": 3 * MS}})


def test_the_prefill_spread_is_kept_in_the_order_the_steps_ran() -> None:
    base = _base()
    n = 12 * 8
    ordered = prefill_fit(_prompts(base, list(range(n))), base, base)
    shuffled = prefill_fit(_prompts(base, list(np.random.default_rng(1).permutation(n))),
                           base, base)
    assert shuffled == ordered
    # a prompt's later chunks: seven alike in a row, then the next prompt's
    spread = np.asarray(ordered.spread_s)
    assert len(spread) == 12 * 7
    assert np.ptp(spread[:7]) < 1e-9 and abs(spread[7] - spread[0]) > 1.5 * MS


def test_a_long_prompts_simulated_chunks_keep_the_real_ones_likeness() -> None:
    base = _base()
    fit = prefill_fit(_prompts(base, list(range(96))), base, base)
    assert isinstance(fit, StepFit)
    sums = []
    for seed in range(20):
        c = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t", steps={"prefill": fit},
                        seed=seed)
        sums += [sum(c.prefill_extra_s() for _ in range(7)) for _ in range(40)]
    # the real prompts' sums are 0 or 7 x 2 ms apart (variance 49 ms^2); seven draws that
    # keep the order vary ~21 ms^2 (a window of seven straddles two prompts), seven
    # independent ones 7x the residuals' variance (7 ms^2)
    independent = 7 * float(np.var(fit.spread_s))
    assert np.var(sums) > 2 * independent
