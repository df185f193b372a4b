"""Seeded workload generation (bench/workload.py): reproducibility and distributions."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.workload import (
    LengthDist,
    TenantSpec,
    WorkloadSpec,
    arrival_times,
    build_workload,
    load_sharegpt,
    summarize_workload,
)

SAMPLE = Path(__file__).resolve().parents[2] / "bench" / "data" / "sharegpt_sample.json"
TINY = LengthDist.fixed(1)  # keeps big-N arrival/tenant tests cheap


def test_same_seed_same_workload_different_seed_different() -> None:
    spec = WorkloadSpec(num_requests=50, request_rate=5.0, mix="mixed", seed=7, long_fraction=0.3)
    a, b = build_workload(spec), build_workload(spec)
    assert a == b
    c = build_workload(replace(spec, seed=8))
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_poisson_rate_matches_mean_interarrival() -> None:
    spec = WorkloadSpec(
        num_requests=5000, request_rate=20.0, seed=1, prompt_len=TINY, output_len=TINY
    )
    t = np.array([r.arrival_s for r in build_workload(spec)])
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert np.mean(np.diff(t)) == pytest.approx(1 / 20.0, rel=0.04)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_interarrival_cv(burstiness: float) -> None:
    gaps = np.diff(arrival_times(5000, 10.0, burstiness, np.random.default_rng(3)))
    assert gaps.mean() == pytest.approx(0.1, rel=0.06)
    # gamma(shape k): CV = 1/sqrt(k) -> 2.0 bursty, 1.0 Poisson, 0.5 regular
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_infinite_rate_sends_everything_at_once() -> None:
    reqs = build_workload(WorkloadSpec(num_requests=10, prompt_len=TINY, output_len=TINY))
    assert all(r.arrival_s == 0.0 for r in reqs)


def test_length_distributions() -> None:
    rng = np.random.default_rng(0)
    u = LengthDist.uniform(10, 20).sample(rng, 5000)
    assert u.min() == 10 and u.max() == 20
    ln = LengthDist.lognormal(median=300, sigma=0.8, lo=1, hi=100_000).sample(rng, 5000)
    assert np.median(ln) == pytest.approx(300, rel=0.05)
    clipped = LengthDist.lognormal(median=300, sigma=2.0, lo=50, hi=400).sample(rng, 2000)
    assert clipped.min() == 50 and clipped.max() == 400
    assert set(LengthDist.fixed(7).sample(rng, 5)) == {7}
    with pytest.raises(ValueError, match="hi"):
        LengthDist.uniform(5, 4)


def test_chat_and_long_doc_defaults_and_vocab_range() -> None:
    chat = build_workload(WorkloadSpec(num_requests=200, mix="chat", vocab_range=(5, 9)))
    assert all(64 <= r.prompt_len <= 256 and 64 <= r.max_tokens <= 256 for r in chat)
    assert {t for r in chat for t in r.prompt_token_ids} <= set(range(5, 9))
    long = build_workload(WorkloadSpec(num_requests=20, mix="long-doc"))
    assert all(2048 <= r.prompt_len <= 8192 and r.kind == "long" for r in long)


def test_mixed_long_fraction() -> None:
    spec = WorkloadSpec(
        num_requests=2000, mix="mixed", long_fraction=0.1, seed=2,
        long_prompt_len=LengthDist.fixed(1000), output_len=TINY, prompt_len=LengthDist.fixed(10),
    )  # fmt: skip
    reqs = build_workload(spec)
    longs = [r for r in reqs if r.kind == "long"]
    assert len(longs) / len(reqs) == pytest.approx(0.1, abs=0.02)
    assert {r.prompt_len for r in longs} == {1000}
    assert {r.prompt_len for r in reqs if r.kind == "chat"} == {10}


def test_tenant_shares_and_attributes() -> None:
    tenants = (
        TenantSpec("a", share=1), TenantSpec("b", share=2, priority=1),
        TenantSpec("c", share=7, weight=3, ttft_deadline_ms=500.0),
    )  # fmt: skip
    spec = WorkloadSpec(num_requests=5000, tenants=tenants, prompt_len=TINY, output_len=TINY)
    reqs = build_workload(spec)
    counts = summarize_workload(reqs)["tenants"]
    for name, share in (("a", 0.1), ("b", 0.2), ("c", 0.7)):
        assert counts[name] / 5000 == pytest.approx(share, abs=0.02)
    assert all(r.priority == 1 for r in reqs if r.tenant == "b")
    assert all(r.ttft_deadline_ms == 500.0 for r in reqs if r.tenant == "c")


def test_shared_prefix_requests_really_share_the_prefix() -> None:
    spec = WorkloadSpec(num_requests=40, mix="shared-prefix", num_prefix_groups=3, prefix_len=100)
    reqs = build_workload(spec)
    groups: dict[int, list] = {}
    for r in reqs:
        assert r.kind == "shared-prefix" and 132 <= r.prompt_len <= 228
        groups.setdefault(r.prefix_group, []).append(r.prompt_token_ids)
    assert set(groups) == {0, 1, 2}
    for ids in groups.values():
        assert all(x[:100] == ids[0][:100] for x in ids)
        assert len({tuple(x[100:]) for x in ids}) == len(ids)  # distinct suffixes
    assert groups[0][0][:100] != groups[1][0][:100]


def test_scale_and_model_len_clipping() -> None:
    big = WorkloadSpec(num_requests=30, mix="long-doc", scale=0.01, seed=4)
    assert all(20 <= r.prompt_len <= 82 for r in build_workload(big))
    capped = WorkloadSpec(num_requests=30, mix="long-doc", max_model_len=256, max_prompt_len=200)
    for r in build_workload(capped):
        assert r.prompt_len <= 200 and r.prompt_len + r.max_tokens <= 256 and r.max_tokens >= 1


def test_sharegpt_lengths_from_words_or_tokenizer() -> None:
    pairs = load_sharegpt(SAMPLE)
    assert len(pairs) == 8 and all(p >= 4 and o >= 4 for p, o in pairs)
    by_chars = load_sharegpt(SAMPLE, tokenizer=lambda s: list(range(len(s))))
    assert all(p > q for (p, _), (q, _) in zip(by_chars, pairs, strict=True))
    spec = WorkloadSpec(num_requests=20, mix="sharegpt", dataset_path=str(SAMPLE), seed=3)
    reqs = build_workload(spec)
    assert {(r.prompt_len, r.max_tokens) for r in reqs} <= set(pairs)
    assert len({(r.prompt_len, r.max_tokens) for r in reqs}) == 8  # every pair used


def test_spec_validation_names_the_field() -> None:
    for kwargs, field in (
        ({"num_requests": 0}, "num_requests"),
        ({"request_rate": 0.0}, "request_rate"),
        ({"mix": "nope"}, "mix"),
        ({"mix": "sharegpt"}, "dataset_path"),
        ({"tenants": (TenantSpec("a"), TenantSpec("a"))}, "tenants"),
        ({"vocab_range": (10, 10)}, "vocab_range"),
    ):
        with pytest.raises(ValueError, match=field):
            WorkloadSpec(**kwargs)
    with pytest.raises(ValueError, match="share"):
        TenantSpec("x", share=0)
