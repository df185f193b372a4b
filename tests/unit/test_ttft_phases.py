"""A request's TTFT split into its phases, each on the clock that saw it, per tenant: in
the records and the bench's table and JSON, in the router's usage, and as the
`pdserve:ttft_phase_seconds{phase,tenant}` histograms."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from bench.metrics import compute_metrics
from bench.records import TTFT_PHASES, RequestRecord, phase_times
from cluster.metrics import MAX_TENANT_LABELS, ServiceMetrics
from cluster.router.types import Usage


def record(rid: str, tenant: str, ttft: float, *, adm: float, queue: float, prefill: float,
           router: float) -> RequestRecord:
    usage = Usage(ttft_s=router, admission_s=adm, queue_s=queue, prefill_s=prefill)
    return RequestRecord(rid, 16, 10.0, (10.0 + ttft, 10.0 + ttft + 0.01), tenant=tenant,
                         **phase_times(usage))


def test_the_phases_add_up_to_the_clients_ttft() -> None:
    r = record("a", "gold", 0.100, adm=0.010, queue=0.020, prefill=0.040, router=0.085)
    parts = r.ttft_phases()
    assert list(parts) == list(TTFT_PHASES)
    assert parts["control"] == pytest.approx(0.015) and parts["delivery"] == pytest.approx(0.015)
    assert sum(parts.values()) == pytest.approx(r.ttft)
    # no server phases (another backend, or a request that failed early): no split
    assert RequestRecord("b", 4, 0.0, (0.1,)).ttft_phases() is None
    assert record("c", "x", 0.1, adm=0.0, queue=0.0, prefill=0.0, router=0.0).ttft_phases() \
        is None


def test_the_bench_reports_a_phase_table_per_tenant() -> None:
    recs = [record(f"g{i}", "gold", 0.10 + i * 0.01, adm=0.01, queue=0.02 + i * 0.005,
                   prefill=0.04, router=0.09 + i * 0.01) for i in range(5)]
    recs += [record(f"f{i}", "free", 0.30, adm=0.10, queue=0.10, prefill=0.05, router=0.28)
             for i in range(3)]
    m = compute_metrics(recs, 10.0)
    assert list(m.ttft_phases) == ["all", "gold", "free"]
    gold = m.ttft_phases["gold"]
    assert gold["prefill_queue"].median == pytest.approx(0.03)
    assert gold["admission"].count == 5 and m.ttft_phases["free"]["admission"].median == \
        pytest.approx(0.10)
    assert m.ttft_phases["free"]["delivery"].median == pytest.approx(0.02)
    text = m.format()
    assert "TTFT by phase, p50 / p99 (ms)" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("free"))
    assert "100.0/100.0" in row and row.split()[-1] == "3"
    assert "Phase p50s summed / TTFT p50:" in text
    js = m.to_json_dict()
    assert js["ttft_phases_ms"]["gold"]["prefill_compute"]["median"] == pytest.approx(40.0)
    assert js["ttft_phase_sum_over_ttft_p50"] == pytest.approx(m.phase_sum_ratio())
    # one tenant: one row, "all"
    one = compute_metrics(recs[:5], 10.0)
    assert list(one.ttft_phases) == ["all"]
    # a request whose phases all come from one request: the p50s add up to its TTFT
    solo = compute_metrics(recs[:1], 10.0)
    assert solo.phase_sum_ratio() == pytest.approx(1.0)


def test_the_router_observes_the_server_side_phases_per_tenant() -> None:
    m = ServiceMetrics()
    m.observe_finish(Usage(ttft_s=0.09, admission_s=0.01, queue_s=0.02, prefill_s=0.04,
                           e2e_s=0.5), "gold")
    m.observe_finish(Usage(ttft_s=0.0, e2e_s=0.1), "gold")  # no first token: not observed
    text = generate_latest(m.registry).decode()
    for phase in ("admission", "prefill_queue", "prefill_compute", "control"):
        assert f'pdserve:ttft_phase_seconds_count{{phase="{phase}",tenant="gold"}} 1.0' in text
    key = 'pdserve:ttft_phase_seconds_sum{phase="control",tenant="gold"} '
    assert float(text.split(key)[1].split()[0]) == pytest.approx(0.02)
    for i in range(MAX_TENANT_LABELS + 5):  # clients name tenants: the series are bounded
        m.observe_finish(Usage(ttft_s=0.09, queue_s=0.02, prefill_s=0.04), f"t{i}")
    tenants = {ln.split('tenant="')[1].split('"')[0] for ln in
               generate_latest(m.registry).decode().splitlines()
               if ln.startswith("pdserve:ttft_phase_seconds_count")}
    assert len(tenants) == MAX_TENANT_LABELS + 1 and "other" in tenants


def test_the_router_and_the_bench_split_by_one_rule() -> None:
    """cluster/ttft_phases.py is the one copy: the histograms hold what the records say,
    and a first token that no prefill made is split by neither."""
    r = record("a", "gold", 0.100, adm=0.010, queue=0.020, prefill=0.040, router=0.085)
    m = ServiceMetrics()
    m.observe_finish(Usage(ttft_s=0.085, admission_s=0.010, queue_s=0.020, prefill_s=0.040),
                     "gold")
    m.observe_finish(Usage(ttft_s=0.05, admission_s=0.01), "gold")  # no prefill: no split
    text = generate_latest(m.registry).decode()
    for phase, seconds in r.ttft_phases().items():
        key = f'pdserve:ttft_phase_seconds_sum{{phase="{phase}",tenant="gold"}} '
        if phase == "delivery":  # the client's part: the router never sees it
            assert key not in text
            continue
        assert float(text.split(key)[1].split()[0]) == pytest.approx(seconds)
    assert record("b", "x", 0.1, adm=0.01, queue=0.0, prefill=0.0, router=0.05).ttft_phases() \
        is None


def test_the_p50_split_adds_up_to_the_ttft_p50_where_the_phase_p50s_do_not() -> None:
    """A third of the requests wait at admission, a third at the prefill queue, a third
    at neither: each phase's p50 is small, the TTFT's is not; the requests nearest the
    p50 split it into what it holds."""
    recs = [record(f"a{i}", "gold", 0.300 + i * 1e-3, adm=0.2 + i * 1e-3, queue=0.01,
                   prefill=0.05, router=0.29 + i * 1e-3) for i in range(7)]
    recs += [record(f"q{i}", "gold", 0.300 + i * 1e-3, adm=0.01, queue=0.2 + i * 1e-3,
                    prefill=0.05, router=0.29 + i * 1e-3) for i in range(7)]
    recs += [record(f"n{i}", "gold", 0.1, adm=0.01, queue=0.01, prefill=0.05, router=0.09)
             for i in range(6)]
    m = compute_metrics(recs, 10.0)
    assert m.phase_sum_ratio() < 0.7  # the p50s of the parts miss the whole's
    p50, parts = m.ttft_p50_split["all"]
    assert p50 == pytest.approx(m.ttft.median)
    assert sum(parts.values()) == pytest.approx(p50, rel=0.01)
    assert "TTFT p50 by phase" in m.format()
    js = m.to_json_dict()["ttft_p50_phases_ms"]["all"]
    assert js["ttft_p50"] == pytest.approx(p50 * 1e3)


def test_a_later_legs_recomputed_prefill_does_not_replace_the_first_tokens_times() -> None:
    """A leg preempted (or refused) after its first token streamed is recomputed by a new
    leg, whose prefill also reports a first token: the request's TTFT is the first leg's,
    so its queue and prefill times stay the first leg's (the second's, waited for after
    the first token, made the control phase negative, down to -623 ms saturated)."""
    from cluster.router.delta_stream import DeltaStream
    from cluster.router.flight import Flight
    from cluster.router.types import GenerateSpec
    from engine import SamplingParams
    from runtime.messages import EventKind, LegTiming

    flight = Flight(GenerateSpec("r", (1, 2), SamplingParams()), DeltaStream("r"), 0.0)
    flight.add_timing(EventKind.FIRST_TOKEN, LegTiming(queue_s=0.02, prefill_s=0.04))
    flight.add_timing(EventKind.TOKENS, LegTiming(decode_s=0.5))
    flight.add_timing(EventKind.FIRST_TOKEN, LegTiming(queue_s=0.9, prefill_s=0.3))  # leg 2
    flight.add_timing(EventKind.TOKENS, LegTiming(decode_s=0.25))
    t = flight.timing
    assert (t.queue_s, t.prefill_s) == (0.02, 0.04)
    assert t.decode_s == pytest.approx(0.75)  # decode time adds up over the legs
