"""Runs merged for the fits (bench/studies/service.py ``merge_runs``) and a run's heap
held off the collector (``heap_frozen``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.studies.service import RunOutput, merge_runs
from engine.tracing import TraceEvent
from tests.step_runs import MS
from tests.step_runs import linear_costs as _base
from tests.step_runs import step_run as _run
from tools.sim_validate_fits import step_fits


def _later(run: RunOutput, dt: float) -> RunOutput:
    return RunOutput(run.records, [replace(e, start=e.start + dt, end=e.end + dt)
                                   for e in run.events], run.worker_stats)


def test_merged_runs_tag_their_request_ids_and_sum_each_workers_steps() -> None:
    base = _base()
    a = _run(base, p_scale=1.0, p_offset=MS, post=0.0, d_scale=1.0, d_offset=0.2 * MS)
    b = _later(_run(base, p_scale=1.0, p_offset=3 * MS, post=0.0, d_scale=1.0,
                    d_offset=0.2 * MS), 1000.0)
    b.events.append(TraceEvent("x,y", "decode_batch", "decode-0", 1500.0, 1500.001))
    b.events.append(TraceEvent("*", "decode_batch", "decode-0", 1501.0, 1501.001))
    m = merge_runs([a, b])
    assert [r.request_id for r in m.records] == [f"{i}/r{k}" for i in (0, 1)
                                                 for k in range(6)]
    assert m.events[0].request_id == "0/r0#x#1"
    assert [e.request_id for e in m.events[-2:]] == ["1/x,1/y", "*"]
    assert len(m.events) == len(a.events) + len(b.events)
    pre = m.worker_stats["prefill-0"]
    assert pre["steps"] == 12
    assert pre["mean_step_s"] == pytest.approx((a.worker_stats["prefill-0"]["mean_step_s"]
                                                + b.worker_stats["prefill-0"]["mean_step_s"])
                                               / 2, rel=1e-12)


def test_fits_over_merged_runs_pool_their_steps_within_each_run() -> None:
    base = _base()
    runs = [_later(_run(base, p_scale=1.0, p_offset=MS, post=0.0, d_scale=1.0,
                        d_offset=off), 1000.0 * i)
            for i, off in enumerate((0.6 * MS, 0.2 * MS, 0.2 * MS))]
    fits = step_fits(merge_runs(runs), base, base)
    d = fits["decode"]
    assert d.offset_s == pytest.approx(0.2 * MS, rel=1e-6)  # the slow run is outvoted
    # 8 steady periods a run: a run's last step and the next run's first make no period
    # (the runs reuse request ids; tagged, their legs are not the same legs)
    assert len(d.spread_s) == 3 * 8
    one = step_fits(runs[1], base, base)["prefill"]
    assert (fits["prefill"].scale, fits["prefill"].offset_s) == pytest.approx(
        (one.scale, one.offset_s), rel=1e-6)


def test_a_run_holds_the_objects_before_it_off_the_collector_and_gives_them_back() -> None:
    import gc

    from bench.studies.service import heap_frozen

    before = [object()]  # an object alive when the run starts
    frozen = gc.get_freeze_count()
    with heap_frozen():
        assert gc.get_freeze_count() > frozen
        assert all(o is not before for o in gc.get_objects())  # off the collector
        during = [object()]
        assert any(o is during for o in gc.get_objects())  # the run's own: on it
    assert gc.get_freeze_count() == 0
    assert any(o is before for o in gc.get_objects())
