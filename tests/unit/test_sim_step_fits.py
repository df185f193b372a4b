"""Per-role step fits under load (tools/sim_validate_fits.py) and their use in the
contention-scaled cost model (tools/sim_scaled.py StepFit): a step's traced span against the
calibrated compute, read back as the calibrated compute plus a per-step offset."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.records import RequestRecord
from bench.studies.service import RunOutput
from engine.costs.loader import load_costs
from engine.tracing import TraceEvent
from tests.step_runs import DECODE_BATCHES, MS
from tests.step_runs import linear_costs as _base
from tests.step_runs import step_run as _run
from tools.sim_scaled import ScaledCosts, StepFit
from tools.sim_validate_fits import step_fits


def test_the_fits_read_back_the_offsets_the_run_was_made_of() -> None:
    base = _base()
    run = _run(base, p_scale=1.0, p_offset=1.6 * MS, post=0.5 * MS, d_scale=1.0,
               d_offset=0.2 * MS)
    fits = step_fits(run, base, base)
    p, d = fits["prefill"], fits["decode"]
    # the requests' queue waits (0.1 .. 5.1 ms) are not in the step: the dispatch has them
    assert (p.scale, p.offset_s) == pytest.approx((1.0, 1.6 * MS), rel=1e-6)
    exports = np.mean([base.kv_export_s(c) for c in (16, 64, 128, 256, 256, 32)])
    finals = base.sample_s(1)  # every chunk here ends its prompt: one first token each
    assert p.overhead_s == pytest.approx(0.5 * MS - exports - finals, rel=1e-6)
    assert (d.scale, d.offset_s, d.overhead_s) == pytest.approx((1.0, 0.2 * MS, 0.0), rel=1e-6)
    assert d.join_s == 0.0  # too few steady steps of one batch to say what a join adds


def test_a_step_legs_join_costs_what_its_span_exceeds_the_steady_steps_by() -> None:
    base, events, t = _base(), [], 0.0
    legs = ["a"]
    for k in range(19):  # batch 1 at 0.3 ms; every third step a new leg takes over, 0.9 ms
        if k % 3 == 2:
            legs = [f"n{k}"]
        span = (0.9 if k % 3 == 2 else 0.3) * MS
        events.append(TraceEvent(f"{legs[0]}#x#1", "decode_step", "decode-0", t, t + span,
                                 past_kv_tokens=40 + k))
        t += span + 0.1 * MS
    run = RunOutput([], events, {"decode-0": {"role": "decode", "steps": 19,
                                              "mean_step_s": MS}})
    assert step_fits(run, base, base)["decode"].join_s == pytest.approx(0.6 * MS, rel=1e-6)


def test_prefill_reads_back_a_slope_in_range_and_decode_the_median_difference() -> None:
    base = _base()
    run = _run(base, p_scale=1.5, p_offset=MS, post=0.0, d_scale=1.5, d_offset=0.0)
    fits = step_fits(run, base, base)
    assert (fits["prefill"].scale, fits["prefill"].offset_s) == pytest.approx((1.5, MS))
    steep = _run(base, p_scale=3.0, p_offset=0.0, post=0.0, d_scale=1.0, d_offset=0.0)
    pred = [base.prefill_s([cp]) for cp in [(16, 0), (64, 0), (128, 128), (256, 0),
                                            (256, 256), (32, 0)]]
    p = step_fits(steep, base, base)["prefill"]  # slope 3 is out of range: scale 1, and
    # the median gap (the typical step), the rest of each step drawn from its spread
    assert (p.scale, p.offset_s) == pytest.approx((1.0, 2.0 * np.median(pred)), rel=1e-6)
    assert np.median(p.spread_s) == pytest.approx(0.0, abs=1e-12)
    assert np.mean(p.spread_s) == pytest.approx(2.0 * (np.mean(pred) - np.median(pred)))
    # the periods of the steady steps: not the first (legs joined), not the last (no next)
    runs = [float(np.asarray(base.decode_run_s(b, b * 41 + b * (b - 1) // 2 + b,
                                               40 + b, 1))[0]) for b in DECODE_BATCHES[1:-1]]
    assert fits["decode"].offset_s == pytest.approx(0.5 * np.median(runs), rel=1e-6)


def test_a_nap_between_decode_steps_is_not_a_period_and_a_stall_with_legs_running_is(
        ) -> None:
    base = _base()
    napped = _run(base, p_scale=1.0, p_offset=0.0, post=0.0, d_scale=1.0, d_offset=0.2 * MS,
                  nap_at=2)
    assert step_fits(napped, base, base)["decode"].offset_s == pytest.approx(0.2 * MS,
                                                                              rel=1e-6)
    # legs ran on through a 1 ms stall after every step: every period is 1 ms slower
    slow = _run(base, p_scale=1.0, p_offset=0.0, post=0.0, d_scale=1.0, d_offset=0.2 * MS,
                gaps=(1 * MS,) * len(DECODE_BATCHES))
    assert step_fits(slow, base, base)["decode"].offset_s == pytest.approx(1.2 * MS, rel=1e-6)
    # one 20 ms stall among eight periods: the median period stays, the spread has it
    one = _run(base, p_scale=1.0, p_offset=0.0, post=0.0, d_scale=1.0, d_offset=0.2 * MS,
               gaps=(0.0, 0.0, 0.0, 20 * MS))
    d = step_fits(one, base, base)["decode"]
    assert d.offset_s == pytest.approx(0.2 * MS, rel=1e-6)
    assert sorted(d.spread_s) == pytest.approx([0.0] * 7 + [20 * MS], abs=1e-9)


def test_few_steps_give_no_fit() -> None:
    base = _base()
    few = _run(base, p_scale=1.0, p_offset=0.0, post=0.0, d_scale=1.0, d_offset=0.0)
    few.events[:] = [e for e in few.events if e.phase == "prefill_chunk"][:3]
    assert step_fits(few, base, base) == {}


def test_a_step_fit_replaces_its_roles_factor_in_the_scaled_costs() -> None:
    base = _base()
    s = ScaledCosts(base, {"prefill": 9.0, "decode": 2.0}, "probe",
                    steps={"prefill": StepFit(0.5, 1 * MS, 0.25 * MS)})
    assert s.prefill_s([(64, 0)]) == pytest.approx(0.5 * base.prefill_s([(64, 0)]) + MS)
    assert s.step_overhead_s("prefill", 3) == pytest.approx(0.25 * MS)
    assert s.kv_export_s(64) == pytest.approx(9.0 * base.kv_export_s(64))  # still the factor
    assert s.decode_s(1, 100) == pytest.approx(2.0 * base.decode_s(1, 100))
    d = ScaledCosts(base, {"prefill": 1.0, "decode": 2.0}, "probe",
                    steps={"decode": StepFit(1.5, 0.2 * MS, 0.0)})
    run = np.asarray(base.decode_run_s(2, 90, 46, 4))
    assert np.asarray(d.decode_run_s(2, 90, 46, 4)) == pytest.approx(1.5 * run + 0.2 * MS)
    assert d.step_overhead_s("decode", 2) == 0.0
    assert "decode 1.50x + 0.20 ms per step, overhead 0.00 ms" in d.label
    with pytest.raises(ValueError, match="step fits are per role"):
        ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "p", steps={"router": d.steps["decode"]})
    with pytest.raises(ValueError, match="scale > 0"):
        StepFit(0.0, 0.0, 0.0)


def _simulated(join_s: float, stepping: str = "fast", n: int = 1):
    from bench.workload import WorkloadSpec, build_workload
    from engine.costs.analytic import analytic_calibration
    from sim.adapters import ServeConfig
    from sim.cluster import Simulation
    from sim.options import SimOptions

    base = load_costs(analytic_calibration("h200", "llama-3-8b"))
    costs = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t",
                        steps={"decode": StepFit(1.0, 0.0, 0.0, join_s)})
    cfg = ServeConfig().with_values({"pools.prefill_workers": 1, "pools.decode_workers": 1})
    sim = Simulation(cfg, costs, SimOptions(interconnect="infiniband", decode_stepping=stepping))
    out = sim.run(build_workload(WorkloadSpec(num_requests=n, request_rate=50, seed=1,
                                              vocab_range=(1, 1000))))
    sim.check_quiescent()
    return out.records()


def test_the_simulator_adds_the_join_to_the_step_a_leg_joins_only() -> None:
    (alone,), (joined,) = _simulated(0.0), _simulated(2 * MS)
    assert joined.token_times[0] == alone.token_times[0]  # the first token is the prefill's
    gaps = np.diff(joined.token_times) - np.diff(alone.token_times)
    assert gaps[0] == pytest.approx(2 * MS, abs=1e-9) and gaps[1:] == pytest.approx(0, abs=1e-9)
    # and fast stepping still runs the steps the real scheduler runs one by one
    assert _simulated(2 * MS, "fast", 40) == _simulated(2 * MS, "exact", 40)


def test_a_decode_step_adds_a_draw_of_the_spread_repeatably_and_keeps_the_median() -> None:
    base = _base()
    fit = StepFit(1.0, 0.2 * MS, 0.0, 0.0, (0.0, 0.0, 0.0, -0.1 * MS, 4 * MS))
    assert StepFit(**fit.to_dict()) == fit  # the validation's JSON reads back
    a, b = (ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t", steps={"decode": fit})
            for _ in range(2))
    plain = float(np.asarray(base.decode_run_s(2, 90, 46, 1))[0]) + 0.2 * MS
    one_by_one = np.concatenate([a.decode_run_s(2, 90, 46, 1) for _ in range(2000)])
    # the draws go in call order, whatever the run lengths asked: the same steps
    assert np.concatenate([b.decode_run_s(2, 90, 46, k) for k in (1, 999, 1000)]) \
        == pytest.approx(one_by_one)
    extra = one_by_one - plain
    assert set(np.round(extra / MS, 6)) == {0.0, -0.1, 4.0}
    assert np.median(extra) == pytest.approx(0.0, abs=1e-12)
    assert np.mean(extra > 0) == pytest.approx(0.2, abs=0.03)  # one value in five
    assert "spread drawn from 5 real steps" in a.label
    with pytest.raises(ValueError, match="spread must be finite"):
        StepFit(1.0, 0.0, 0.0, 0.0, (float("nan"),))


def test_a_shallow_slope_is_kept_when_the_steps_pin_it_down_and_dropped_when_noise_does() -> None:
    from tools.sim_validate_fits import _fit

    rng = np.random.default_rng(3)
    x = rng.uniform(0.2, 1.7, 200) * MS  # 64-token chunks over contexts 0..1400, as measured
    tight = 0.4 * x + 1.4 * MS + rng.normal(0, 0.05 * MS, 200)
    scale, offset, _ = _fit(list(x), list(tight))
    assert scale == pytest.approx(0.4, abs=0.03) and offset == pytest.approx(1.4 * MS, rel=0.05)
    noisy = 0.4 * x + 1.4 * MS + rng.normal(0, 3 * MS, 200)  # its slope within ~1 SE of 0
    assert _fit(list(x), list(noisy)) == pytest.approx(
        (1.0, max(float(np.mean(noisy - x)), 0.0), 0.0), rel=1e-9)


def test_a_first_chunk_costs_its_own_excess_and_the_typical_step_is_the_median() -> None:
    from tools.sim_validate_fits import _fit, prefill_fit

    rng = np.random.default_rng(1)
    x = rng.uniform(0.2, 1.7, 300) * MS
    first = rng.uniform(size=300) < 0.4  # the step runs a request's first chunk
    y = 0.5 * x + 1.2 * MS + 0.3 * MS * first + rng.normal(0, 0.05 * MS, 300)
    assert _fit(list(x), list(y), first=list(first)) == pytest.approx(
        (0.5, 1.2 * MS, 0.3 * MS), rel=0.05)
    # skewed steps (one in five 2 ms slower): the line of the typical ones, the rest drawn
    base, events, t = _base(), [], 0.0
    for i in range(100):
        c, p = (64, 0) if i % 2 == 0 else (64, 64 * (1 + i % 7))
        span = base.prefill_s([(c, p)]) + 1.0 * MS + (2 * MS if i % 5 == 4 else 0.0)
        events.append(TraceEvent(f"r{i}#x#1", "prefill_chunk", "prefill-0", t, t + span,
                                 scheduled_tokens=c, past_kv_tokens=p, token_start=p,
                                 token_end=p + c))
        t += span + MS
    run = RunOutput([], events, {"prefill-0": {"role": "prefill", "steps": 100,
                                               "mean_step_s": 3 * MS}})
    f = prefill_fit(run, base, base)
    assert (f.scale, f.offset_s) == pytest.approx((1.0, 1.0 * MS), rel=1e-6)
    assert f.join_s == pytest.approx(0.0, abs=1e-9)  # first chunks cost no more here
    assert sorted(set(np.round(np.asarray(f.spread_s) / MS, 9))) == [0.0, 2.0]
    assert len(f.spread_s) == len(f.join_spread_s) == 50  # each kind's own residuals
    assert sorted(set(np.round(np.asarray(f.join_spread_s) / MS, 9))) == [0.0, 2.0]


def test_first_chunks_draw_their_own_spread_and_later_chunks_theirs() -> None:
    from tools.sim_validate_fits import prefill_fit

    # a first chunk meets a worker that idled: slow and spread wide; later chunks run
    # back to back, tight: each kind's simulated steps must keep its own spread
    base, events, t = _base(), [], 0.0
    rng = np.random.default_rng(5)
    for i in range(120):
        c, p = (128, 0) if i % 4 == 0 else (128, 128 * (i % 4))
        extra = rng.uniform(1, 15) * MS if p == 0 else rng.uniform(0, 0.2) * MS
        span = base.prefill_s([(c, p)]) + 1.0 * MS + extra
        events.append(TraceEvent(f"r{i // 4}#x#1", "prefill_chunk", "prefill-0", t, t + span,
                                 scheduled_tokens=c, past_kv_tokens=p, token_start=p,
                                 token_end=p + c))
        t += span + (60 * MS if i % 4 == 3 else 0.0)
    run = RunOutput([], events, {"prefill-0": {"role": "prefill", "steps": 120,
                                               "mean_step_s": 5 * MS}})
    f = prefill_fit(run, base, base)
    assert len(f.join_spread_s) == 30 and len(f.spread_s) == 90
    assert np.ptp(f.join_spread_s) > 10 * MS and np.ptp(f.spread_s) < 0.25 * MS
    c = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t", steps={"prefill": f})
    later = [c.prefill_extra_s() for _ in range(300)]
    first = [c.prefill_extra_s(first=True) for _ in range(300)]
    assert np.ptp(later) < 0.25 * MS and np.ptp(first) > 10 * MS
    assert "30 with a first chunk apart" in c.label
    assert StepFit(**f.to_dict()) == replace(  # the validation's JSON reads back
        f, spread_s=tuple(round(x, 7) for x in f.spread_s),
        join_spread_s=tuple(round(x, 7) for x in f.join_spread_s))
    one_pool = replace(f, join_spread_s=())  # older fits: every step draws from one pool
    c = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t", steps={"prefill": one_pool})
    assert np.ptp([c.prefill_extra_s(first=True) for _ in range(300)]) < 0.25 * MS


def test_the_scaled_prefill_step_adds_the_first_chunks_excess_and_a_draw_per_step() -> None:
    base = _base()
    fit = StepFit(1.0, 0.5 * MS, 0.0, 0.3 * MS, (0.0, 0.0, 0.0, 2 * MS))

    def costs(seed: int = 0) -> ScaledCosts:
        return ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t", steps={"prefill": fit},
                           seed=seed)

    c = costs()
    assert c.prefill_spread and "a step with a first chunk +0.30 ms" in c.label
    later = base.prefill_s([(64, 64)]) + 0.5 * MS
    assert c.prefill_s([(64, 64)]) == pytest.approx(later)
    assert c.prefill_s([(64, 64), (32, 0)]) == pytest.approx(
        base.prefill_s([(64, 64), (32, 0)]) + 0.8 * MS)
    draws = [c.prefill_extra_s() for _ in range(400)]
    assert set(draws) == {0.0, 2 * MS} and np.mean(draws) == pytest.approx(0.5 * MS, rel=0.2)
    again = costs()
    assert draws == [again.prefill_extra_s() for _ in range(400)]  # repeatable per seed
    assert draws != [costs(1).prefill_extra_s() for _ in range(400)]
    plain = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t")
    assert not plain.prefill_spread and plain.prefill_extra_s() == 0.0


def test_a_seed_is_another_draw_of_the_drawn_terms_and_each_seed_repeats() -> None:
    base = _base()
    fit = StepFit(1.0, 0.0, 0.0, 0.0, tuple(k * 0.01 * MS for k in range(50)))
    handoff = (-1 * MS, 2 * MS, 3 * MS, 5 * MS)

    def costs(seed: int) -> ScaledCosts:
        return ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t", steps={"decode": fit},
                           handoff=handoff, seed=seed)

    legs = [f"r{i}#ab#1" for i in range(64)]
    draws = {seed: [costs(seed).handoff_extra_s(leg) for leg in legs] for seed in range(3)}
    assert draws[0] == [costs(0).handoff_extra_s(leg) for leg in reversed(legs)][::-1]
    assert set(draws[0]) <= {0.0, 2 * MS, 3 * MS, 5 * MS}  # measured ones, clipped at 0
    assert draws[0] != draws[1] != draws[2]  # another seed: the legs draw others
    assert ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t", handoff=handoff
                       ).handoff_extra_s(legs[0]) == draws[0][0]  # seed 0 is the default
    zero, one = (np.asarray(costs(seed).decode_run_s(2, 90, 46, 200)) for seed in (0, 1))
    assert not np.allclose(zero, one)  # the decode steps' spread: another stream of draws
    assert np.array_equal(np.asarray(costs(0).decode_run_s(2, 90, 46, 200)), zero)


def test_the_loops_turn_between_a_prompts_chunks_is_read_back_and_added_to_later_chunks(
) -> None:
    base = _base()
    events, t, spans, posts = [], 0.0, [], []
    for r in range(2):  # two prompts of eight 64-token chunks, each chunk right after the last
        for k in range(8):
            span = base.prefill_s([(64, 64 * k)]) + MS
            events.append(TraceEvent(f"r{r}#x#1", "prefill_chunk", "prefill-0", t, t + span,
                                     scheduled_tokens=64, past_kv_tokens=64 * k,
                                     token_start=64 * k, token_end=64 * (k + 1)))
            post = base.kv_export_s(64) + (base.sample_s(1) if k == 7 else 0.0)
            spans.append(span)
            posts.append(post)
            t += span + post + 0.1 * MS + 0.3 * MS  # its overhead, then 0.3 ms before the next
        t += 0.05  # the worker idles between the prompts
    records = [RequestRecord(f"r{r}", 512, 0.0) for r in range(2)]
    stats = {"prefill-0": {"role": "prefill", "steps": 16,
                           "mean_step_s": float(np.mean(spans) + np.mean(posts)) + 0.1 * MS}}
    fit = step_fits(RunOutput(records, events, stats), base, base)["prefill"]
    assert fit.overhead_s == pytest.approx(0.1 * MS, rel=1e-6)
    assert fit.between_s == pytest.approx(0.3 * MS, rel=1e-6)  # the idle gap is not a pair
    assert StepFit(**fit.to_dict()).between_s == fit.between_s  # the JSON reads back
    costs = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t", steps={"prefill": fit})
    first, later = costs.prefill_s([(64, 0)]), costs.prefill_s([(64, 64)])
    assert later - first == pytest.approx(base.prefill_s([(64, 64)]) - base.prefill_s([(64, 0)])
                                          + 0.3 * MS - fit.join_s, rel=1e-6)
    assert "a later chunk +0.30 ms before it" in costs.label
