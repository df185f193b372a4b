"""Request records (bench/records.py), serving metrics and fairness (bench/metrics.py)
against hand-computed values."""

from __future__ import annotations

import json

import pytest

from bench.metrics import (
    Dist,
    compute_metrics,
    jain_index,
    meets_slos,
    parse_slo,
    slowdowns,
)
from bench.records import RequestRecord


def rec(rid: str, send: float, times: list[float], prompt: int = 10, **kw: object) -> RequestRecord:
    return RequestRecord(rid, prompt, send, tuple(times), **kw)  # type: ignore[arg-type]


def test_per_request_ttft_tpot_itl_e2el() -> None:
    r = rec("a", 0.0, [1.0, 1.5, 2.5])
    assert r.ttft == 1.0 and r.e2el == 2.5
    assert r.tpot == pytest.approx(0.75)  # (2.5 - 1.0) / (3 - 1): first token excluded
    assert r.itls == pytest.approx([0.5, 1.0])
    one = rec("b", 0.0, [0.3])
    assert one.tpot is None and one.itls == [] and one.e2el == pytest.approx(0.3)
    burst = rec("c", 0.0, [1.0, 2.0], output_len=5, end_time=3.0)
    assert burst.tpot == pytest.approx(0.5)  # (3 - 1) / (5 - 1)
    assert rec("d", 0.0, []).ttft is None


def test_record_validation() -> None:
    with pytest.raises(ValueError, match="token_times"):
        rec("a", 0.0, [1.0, 0.5])
    with pytest.raises(ValueError, match="token_times"):
        rec("a", 2.0, [1.0])
    with pytest.raises(ValueError, match="output_len"):
        rec("a", 0.0, [1.0, 2.0], output_len=1)


def test_percentiles_use_linear_interpolation() -> None:
    d = Dist.of([1.0, 2.0, 3.0, 4.0])
    assert (d.mean, d.median) == (2.5, 2.5)
    assert d.percentiles[90.0] == pytest.approx(3.7)
    assert d.percentiles[99.0] == pytest.approx(3.97)
    empty = Dist.of([])
    assert empty.count == 0 and empty.mean == 0.0


def test_aggregates_pool_itl_and_count_throughput() -> None:
    records = [
        rec("a", 0.0, [0.1, 0.2, 0.3], prompt=100),
        rec("b", 0.0, [0.2, 0.6], prompt=50),
        rec("c", 0.0, [], prompt=7, success=False, finish_reason="error"),
    ]
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert m.itl.mean == pytest.approx(0.2)  # pooled [.1, .1, .4], not mean of means (.25)
    assert m.itl.count == 3
    assert m.ttft.mean == pytest.approx(0.15)
    assert m.tpot.mean == pytest.approx((0.1 + 0.4) / 2)
    assert m.e2el.median == pytest.approx(0.45)
    assert (m.total_input_tokens, m.total_output_tokens) == (150, 5)
    assert m.request_throughput == 1.0 and m.output_throughput == 2.5
    assert m.total_token_throughput == pytest.approx(77.5)
    assert m.request_goodput is None
    assert compute_metrics(records[:2]).duration_s == pytest.approx(0.6)


def test_goodput_under_slos() -> None:
    slos = parse_slo("ttft:200,tpot:100 e2el:1000")
    assert slos == {"ttft": 200.0, "tpot": 100.0, "e2el": 1000.0}
    good = rec("g", 0.0, [0.1, 0.15])
    slow_first = rec("s", 0.0, [0.3, 0.35])
    slow_tokens = rec("t", 0.0, [0.1, 0.3])
    single = rec("one", 0.0, [0.05])  # TPOT undefined: meets the TPOT SLO
    assert meets_slos(good, slos) and meets_slos(single, slos)
    assert not meets_slos(slow_first, slos) and not meets_slos(slow_tokens, slos)
    m = compute_metrics([good, slow_first, slow_tokens, single], duration_s=4.0, slos=slos)
    assert m.request_goodput == pytest.approx(0.5)
    for bad in ("ttft", "foo:3", "ttft:-1"):
        with pytest.raises(ValueError, match="slo"):
            parse_slo(bad)


def test_jain_index() -> None:
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)  # one hog among 4 -> 1/n
    assert jain_index([1.0, 2.0]) == pytest.approx(0.9)  # 9 / (2 * 5)
    with pytest.raises(ValueError):
        jain_index([])


def test_slowdown_sources_and_fairness() -> None:
    a = rec("a", 0.0, [1.0, 2.0], latency_alone_s=1.0)
    b = rec("b", 0.0, [0.5, 1.0], latency_alone_s=1.0)
    assert slowdowns([a, b]) == pytest.approx([2.0, 1.0])
    assert slowdowns([a, b], {"a": 0.5}) == pytest.approx([4.0])
    assert slowdowns([a, b], lambda r: r.e2el) == pytest.approx([1.0, 1.0])
    m = compute_metrics([a, b], duration_s=2.0)
    assert m.jain_slowdown == pytest.approx(0.9)


def test_tenant_fairness_normalised_by_weight() -> None:
    a = rec("a", 0.0, [0.5], prompt=99, tenant="A")  # 100 tokens
    b = rec("b", 0.0, [0.5], prompt=199, tenant="B")  # 200 tokens
    m = compute_metrics([a, b], duration_s=1.0, tenant_weights={"A": 1.0, "B": 2.0})
    assert m.tenant_throughput == {"A": 100.0, "B": 200.0}
    assert m.jain_tenant == pytest.approx(1.0)
    starved = compute_metrics([a], 1.0, tenant_weights={"A": 1.0, "B": 1.0})
    assert starved.jain_tenant == pytest.approx(0.5)


def test_short_ttft_while_long_present_and_queue_wait() -> None:
    long = rec("L", 0.0, [2.0, 3.0], prompt=4096, queue_s=0.5)
    short_during = rec("s1", 1.0, [1.4], prompt=100, queue_s=0.1)
    short_after = rec("s2", 5.0, [5.1], prompt=100)
    m = compute_metrics([long, short_during, short_after], 6.0, long_prompt_threshold=1024)
    assert m.short_ttft_with_long is not None and m.short_ttft_with_long.count == 1
    assert m.short_ttft_with_long.percentiles[99.0] == pytest.approx(0.4)
    assert m.max_queue_wait_s == 0.5
    assert m.phases["queue"].count == 2
    none = compute_metrics([short_after], 1.0)
    assert none.short_ttft_with_long is None and none.max_queue_wait_s is None


def test_printing_and_json() -> None:
    records = [rec("a", 0.0, [0.1, 0.2, 0.3]), rec("b", 0.0, [0.2, 0.6])]
    m = compute_metrics(records, 1.0, slos={"ttft": 150.0})
    text = m.format()
    for line in (
        "============ Serving Benchmark Result ============",
        "Successful requests:", "Benchmark duration (s):", "Request goodput (req/s):",
        "---------------Time to First Token----------------",
        "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
        "Mean TPOT (ms):", "P99 ITL (ms):", "Median E2EL (ms):", "Jain index (slowdown):",
    ):  # fmt: skip
        assert line in text
    assert "Mean TTFT (ms):                          150.00" in text
    d = json.loads(json.dumps(m.to_json_dict()))
    assert d["completed"] == 2 and d["mean_ttft_ms"] == pytest.approx(150.0)
    assert d["p99_itl_ms"] == pytest.approx(m.itl.percentiles[99.0] * 1e3)
    assert d["request_goodput"] == pytest.approx(1.0)
