"""tools/sim_validate_report.py (the validation's figures: the control-plane terms read
from traces against the client's times, the term the table names when a row misses) and
tools/sim_validate_fits.py (the under-load terms fitted to the real runs)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from bench.records import RequestRecord
from bench.studies.service import RunOutput
from engine.tracing import TraceEvent
from tools import sim_validate_fits as terms
from tools import sim_validate_report as sv

MS = 1e-3


def _run(dispatch: float, first: float, lag: float, *, offset: float = 0.0) -> RunOutput:
    """Two requests: sent at 0 and 1 s (client clock), one 2 ms prefill chunk after
    ``dispatch``, the first token ``first`` after it, three 1 ms decode steps each of
    whose tokens arrives ``lag`` after the step (trace clock = client clock + offset)."""
    records, events = [], []
    for i, send in enumerate((0.0, 1.0)):
        leg = f"r{i}#ab1#1"
        c0 = send + offset + dispatch
        events.append(TraceEvent(leg, "prefill_chunk", "prefill-0", c0, c0 + 2 * MS))
        t = [c0 + 2 * MS + first]
        for k in range(3):
            end = t[0] + (k + 1) * MS
            events.append(TraceEvent(leg, "decode_step", "decode-0", end - MS, end))
            t.append(end + lag)
        records.append(RequestRecord(f"r{i}", 8, send, tuple(x - offset for x in t),
                                     finish_reason="length", prefill_s=2 * MS, queue_s=0.0,
                                     transfer_s=MS))
    stats = {"prefill-0": {"role": "prefill", "steps": 2, "mean_step_s": 2 * MS},
             "decode-0": {"role": "decode", "steps": 6, "mean_step_s": MS}}
    return RunOutput(records, events, stats, wall_offset=offset)


def test_control_terms_come_from_traces_against_client_times_across_clocks() -> None:
    terms = sv.control_terms(_run(3 * MS, 0.5 * MS, 0.25 * MS, offset=1000.0))
    assert terms["dispatch p50"] == pytest.approx(3 * MS, abs=1e-6)
    assert terms["dispatch p99"] == pytest.approx(3 * MS, abs=1e-6)
    assert terms["first-token delivery p50"] == pytest.approx(0.5 * MS, abs=1e-6)
    assert terms["token delivery p50"] == pytest.approx(0.25 * MS, abs=1e-6)
    assert terms["token delivery p99"] == pytest.approx(0.25 * MS, abs=1e-6)


def test_contention_is_the_real_mean_step_or_dispatch_over_the_simulated_one() -> None:
    real, sim = _run(6 * MS, 0, 0), _run(2 * MS, 0, 0)
    sim.worker_stats["prefill-0"]["mean_step_s"] = 1 * MS
    assert terms.contention(real, sim) == pytest.approx(
        {"prefill": 2.0, "decode": 1.0, "control": 3.0})


def test_a_row_that_misses_names_the_term_furthest_off() -> None:
    real, sim = sv.summarize(_run(9 * MS, 0.5 * MS, 0.25 * MS)), \
        sv.summarize(_run(3 * MS, 0.5 * MS, 0.25 * MS))
    line = sv.table([{"config": "c", "load": "low", "real": real, "sim": sim}]).splitlines()[-1]
    assert "ttft_p50: dispatch p50 9.00 -> 3.00 ms, 100% of the gap" in line
    assert "ttft_p99: dispatch p99 9.00 -> 3.00 ms, 100% of the gap" in line
    assert "itl_p50" not in line  # the decode side matches
    same = sv.table([{"config": "c", "load": "low", "real": real, "sim": real}])
    assert same.splitlines()[-1].endswith("within 10% |")


def _with_admits(out: RunOutput, handoff: float) -> RunOutput:
    """Each request's decode leg admitted ``handoff`` after its last chunk's compute."""
    chunks = [e for e in out.events if e.phase == "prefill_chunk"]
    out.events.extend(TraceEvent(c.request_id, "decode_admit", "decode-0", c.end + handoff,
                                 c.end + handoff) for c in chunks)
    return out


def test_the_link_factor_makes_the_simulated_mean_kv_handoff_the_real_one() -> None:
    real = _with_admits(_run(3 * MS, 0.5 * MS, 0.25 * MS, offset=50.0), 7 * MS)
    assert terms.handoff_mean(real) == pytest.approx(7 * MS, abs=1e-6)
    # a simulated handoff of 1 ms of post-compute work plus a link write of f x 0.5 ms
    probe = (lambda f: _with_admits(_run(3 * MS, 0, 0), (1 + 0.5 * f) * MS))  # noqa: E731
    assert terms.fit_link_factor(terms.handoff_mean(real), probe) == pytest.approx(12.0, rel=1e-3)
    # faster than the idle link, off the range, nothing measured: the bounds, or as calibrated
    assert terms.fit_link_factor(0.5 * MS, probe) == 0.25
    assert terms.fit_link_factor(1.0, probe) == 256.0
    assert terms.fit_link_factor(terms.handoff_mean(_run(3 * MS, 0, 0)), probe) == 1.0


def test_handoff_residuals_pair_each_leg_of_the_real_run_with_its_simulated_self() -> None:
    real = _with_admits(_run(3 * MS, 0, 0), 7 * MS)
    real.events[-1] = TraceEvent("r1#ab1#1", "decode_admit", "decode-0",
                                 real.events[-1].start + 2 * MS, real.events[-1].start + 2 * MS)
    sim = _with_admits(_run(3 * MS, 0, 0), 1 * MS)
    assert terms.handoff_residuals(real, sim) == pytest.approx([6 * MS, 8 * MS], abs=1e-9)
    sim.events = [e for e in sim.events if not e.request_id.startswith("r0")]
    assert terms.handoff_residuals(real, sim) == pytest.approx([8 * MS], abs=1e-9)  # r1 only


def test_arrival_residuals_pair_each_requests_dispatch_and_take_the_delivery_off_its_first(
) -> None:
    from engine.costs.delivery import Delivery
    from engine.costs.loader import load_costs
    from sim.synthetic import synthetic_calibration
    from tools.sim_scaled import ScaledCosts

    base = load_costs(synthetic_calibration(prefill=lambda c, p: 1e-5 * c,
                                            decode=lambda b, L: 1e-3, sample_s=0.1 * MS,
                                            step_overhead_s=0.2 * MS))
    costs = ScaledCosts(base, {"prefill": 1.0, "decode": 1.0}, "t",
                        delivery=Delivery(0.3 * MS, 0.0))
    after = costs.sample_s(1) + costs.kv_export_s(8) + costs.step_overhead_s("prefill", 1)
    real, sim = _run(3 * MS, 2 * MS, 0.25 * MS, offset=50.0), _run(1 * MS, 0.0, 0.0)
    e = real.events[0]
    real.events[0] = replace(e, start=e.start + 4 * MS, end=e.end + 4 * MS)  # r0's, later
    got = terms.arrival_residuals(real, sim, costs)
    # r0's chunk starts 4 ms later and so ends 4 ms later: dispatch +4 ms, first -4 ms
    assert [x for pair in got for x in pair] == pytest.approx(
        [6 * MS, -2 * MS - after - 0.3 * MS, 2 * MS, 2 * MS - after - 0.3 * MS], abs=1e-9)
    sim.events = [e for e in sim.events if not e.request_id.startswith("r0")]
    assert len(terms.arrival_residuals(real, sim, costs)) == 1  # r1 only: paired by id


def test_the_stall_scale_makes_the_simulated_itl_p99_the_real_one() -> None:
    target = sv.summarize(_run(3 * MS, 0, 2.5 * MS))["itl_p99"]
    # the simulated run's tokens lag their steps by f x 1 ms: its ITL p99 grows with f
    probe = (lambda f: [_run(3 * MS, 0, f * MS)])  # noqa: E731
    f = terms.fit_stall_scale(target, probe)
    assert sv.summarize(probe(f)[0])["itl_p99"] == pytest.approx(target, rel=1e-3)
    assert terms.fit_stall_scale(None, probe) == 1.0
    assert terms.fit_stall_scale(1.0, probe) == 1.0  # out of the stalls' reach: as fitted
    assert terms.fit_stall_scale(0.0, probe) == 0.25  # below it: the smallest
    # seeded runs: the median's ITL p99 is the target (seeds lagging 0.5x, 1x and 9x f ms)
    seeds = (lambda f: [_run(3 * MS, 0, k * f * MS) for k in (0.5, 9.0, 1.0)])  # noqa: E731
    assert terms.fit_stall_scale(target, seeds) == pytest.approx(f, rel=1e-2)


def test_the_real_side_is_the_median_of_its_repeats_with_their_range_shown() -> None:
    runs = [sv.summarize(_run(d * MS, 0.5 * MS, 0.25 * MS)) for d in (3, 9, 4)]
    med = sv.median_summary(runs)
    assert med["ttft_p50"] == pytest.approx(runs[2]["ttft_p50"])  # dispatch 4 ms: the middle
    assert med["terms"]["dispatch p50"] == pytest.approx(4 * MS, abs=1e-6)
    lo, hi = med["spread"]["ttft_p50"]
    assert (lo, hi) == (pytest.approx(runs[0]["ttft_p50"]), pytest.approx(runs[1]["ttft_p50"]))
    # the simulator at run 1's figures: 10%+ off the median, yet within the real range
    row = {"config": "c", "load": "low", "real": med, "sim": runs[0]}
    line = sv.table([row]).splitlines()[-1]
    assert f"[{lo * 1e3:.1f}-{hi * 1e3:.1f}]" in line and "ttft_p50: dispatch p50" in line
    assert sv.within_spread(row, "ttft_p50") and sv.within_spread(row, "itl_p50")
    text = sv.counts([row])
    assert text.startswith("0 of 1 rows within 10%") and "ttft_p50 0/1" in text
    assert "itl_p50 1/1" in text


def test_the_table_shows_the_machines_drift_and_counts_the_rows_where_it_held() -> None:
    run = sv.summarize(_run(3 * MS, 0.5 * MS, 0.25 * MS))
    off = sv.summarize(_run(9 * MS, 0.5 * MS, 0.25 * MS))  # TTFT 10%+ off
    steady = {"config": "a", "load": "low", "real": sv.median_summary([run]), "sim": run,
              "canary_ms": {"fit": [7.0, 7.2, 7.1], "compared": [7.3, 7.2, 7.4]}}
    slow = {**steady, "config": "b", "sim": off,
            "canary_ms": {"fit": [7.0, 7.1, 7.0], "compared": [9.1, 9.0, 8.8]}}
    older = {k: v for k, v in steady.items() if k != "canary_ms"}  # a run before canaries
    lines = sv.table([steady, slow, older]).splitlines()
    assert lines[0].count("|") == lines[2].count("|") == lines[4].count("|")
    assert "| +3% | within 10% |" in lines[2]  # 7.3 / 7.1 ms
    assert "| +29% | ttft_p50" in lines[3]  # 9.0 / 7.0 ms
    assert "| - | within 10% |" in lines[4]
    text = sv.counts([steady, slow, older])
    assert text.startswith("2 of 3 rows within 10%")
    assert text.endswith("the machine canary moved +3% to +29% from a row's fit runs to its "
                         "compared runs; of the 1 rows where it held within 5%, 1 within 10% "
                         "at p50 and p99")
    assert "canary" not in sv.counts([older])


def test_the_machine_canary_times_a_fixed_job_and_its_drift_is_a_ratio_of_medians() -> None:
    import torch

    from tools.machine_canary import canary_s, drift, wake_s

    threads = torch.get_num_threads()
    assert canary_s(repeats=1) > 0.0
    assert torch.get_num_threads() == threads  # one thread while it runs, then as before
    with pytest.raises(ValueError, match="repeats"):
        canary_s(repeats=0)
    assert wake_s(round_trips=3) > 0.0
    assert not any(t.name == "wake-canary" for t in threading.enumerate())  # joined
    with pytest.raises(ValueError, match="round_trips"):
        wake_s(round_trips=0)
    assert drift([2.0, 1.0, 9.0], [3.0]) == pytest.approx(0.5)
    assert drift([], [1.0]) is None and drift([1.0], []) is None


def test_the_header_gives_the_canarys_range_and_the_wake_up_round_trips() -> None:
    from types import SimpleNamespace

    run = sv.summarize(_run(3 * MS, 0.5 * MS, 0.25 * MS))
    row = {"config": "a", "load": "low", "real": sv.median_summary([run]), "sim": run,
           "canary_ms": {"fit": [7.0, 9.5], "compared": [6.5]}, "wake_us": [80.0, 1200.0]}
    cal = SimpleNamespace(data={}, source_of=lambda key: f"{key}: analytic")
    text = sv.describe(cal, [row])
    assert "timed before every real run, 6.50-9.50 ms over this validation" in text
    assert "two threads' wake-up round trip 80-1200 us" in text
    assert "machine:" not in sv.describe(cal, [{**row, "canary_ms": {}}])
    assert "dispatch and first-token delivery" not in text
    # with the idle control plane's figures in the calibration too (their names stay theirs)
    idle = {"rpc_s": 0.5 * MS, "delivery": {"first_token_s": 0.4 * MS, "token_s": 0.1 * MS,
                                            "gap_s": 0.3 * MS, "scope": "router"},
            "service": {"requests": 12, "dispatch_s_median": 2 * MS,
                        "fit_mean_abs_err_s": 0.1 * MS}}
    cal = SimpleNamespace(data={"control": idle}, source_of=cal.source_of)
    drawn = sv.describe(cal, [{**row, "arrival_fit": [[k * MS, -k * MS] for k in range(11)]}])
    assert "first token +0.40 ms, tokens +0.10 ms after their step" in drawn
    assert "dispatch p10 / p50 / p90 +1.00 / +5.00 / +9.00 ms" in drawn
    assert "first token -9.00 / -5.00 / -1.00 ms" in drawn


def test_the_terms_are_fitted_over_the_fit_runs_and_their_simulated_twins_alike() -> None:
    from bench.studies.service import merge_runs
    from tools.sim_validate_row import as_fit_runs

    calls = []

    def run(work: list) -> RunOutput:  # a "simulator": dispatch 2 ms, or 4 ms on the long one
        calls.append(len(work))
        return _run((4 if len(work) > 1 else 2) * MS, 0.5 * MS, 0.25 * MS)

    sim = as_fit_runs(run, ["c", "c"], ["r"], 3)
    assert calls == [2, 1]  # each workload simulated once: a run is deterministic
    assert sorted({r.request_id.split("/")[0] for r in sim.records}) == ["0", "1", "2", "3"]
    # real: the contention run's dispatch 8 ms, the fit runs' 2 ms: the pooled median over
    # the eight requests is the fit runs' 2 ms, as the simulated one is
    real = merge_runs([_run(d * MS, 0.5 * MS, 0.25 * MS) for d in (8, 2, 2, 2)])
    assert terms.contention(real, sim)["control"] == pytest.approx(1.0, rel=1e-6)
    # the first run alone against its own twin: 8 / 4 ms
    first = _run(8 * MS, 0.5 * MS, 0.25 * MS)
    assert terms.contention(first, run(["c", "c"]))["control"] == pytest.approx(2.0, rel=1e-6)


def test_fit_runs_alternate_with_the_compared_runs_and_only_fit_runs_are_fitted() -> None:
    from types import SimpleNamespace

    from tools.sim_validate_row import alternated_runs

    done = []
    svc = SimpleNamespace(run_workload=lambda work, transport: done.append(len(done)) or
                          len(done) - 1)
    canary, wake = {"fit": [], "compared": []}, []
    fits, compared = alternated_runs(svc, ["r"], 3, 2, canary, wake)
    assert fits == [0, 2, 4] and compared == [1, 3]  # a fit run first, then in turn
    assert len(canary["fit"]) == 3 and len(canary["compared"]) == 2 and len(wake) == 5
    fits, compared = alternated_runs(svc, ["r"], 1, 3, canary, wake)
    assert fits == [5] and compared == [6, 7, 8]
    run = sv.summarize(_run(3 * MS, 0.5 * MS, 0.25 * MS))
    row = {"config": "a", "load": "low", "real": sv.median_summary([run]), "sim": run}
    cal = SimpleNamespace(data={}, source_of=lambda key: f"{key}: analytic")
    assert "alternating" not in sv.describe(cal, [row])  # older validations: in turn
    assert "repeats alternating with the fit runs" in sv.describe(
        cal, [{**row, "run_order": "alternated"}])
