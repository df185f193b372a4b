"""tools/sim_validate_emulated.py's comparison (no service): each metric's real median
against the simulated figure, the 10% verdict, the real runs' spread, and for a miss the
term furthest off; and the rows' overrides of the study base configuration."""

from __future__ import annotations

import pytest

from tools import sim_validate_emulated as sve


def figs(ttft50, ttft99, itl50, itl99, **terms):
    base = dict(admission=0.1, prefill_queue=0.5, prefill=10.0, transfer=2.0,
                decode_step=4.0, failed=0.0)
    return {"ttft_p50": ttft50, "ttft_p99": ttft99, "itl_p50": itl50, "itl_p99": itl99,
            **base, **terms}


def test_a_row_compares_medians_and_names_the_term_furthest_off() -> None:
    real = [figs(10, 30, 4.0, 40, transfer=30.0), figs(12, 32, 4.2, 50, transfer=31.0),
            figs(11, 31, 4.1, 45, transfer=29.0)]
    sim = figs(11.5, 30.5, 4.1, 12, transfer=1.5)
    row = sve.compare(real, sim)
    assert row["ttft_p50"]["real"] == 11 and row["ttft_p50"]["err"] == pytest.approx(0.5 / 11)
    assert row["ttft_p50"]["spread"] == pytest.approx(2 / 11) and row["ttft_p50"]["off"] is None
    assert row["itl_p99"]["err"] == pytest.approx(12 / 45 - 1)
    assert row["itl_p99"]["off"] == "transfer -28.50 ms"  # not the decode step (0 off)
    text = sve.table({"r": row}, "a cost model")
    assert "0 of 1 rows within 10%" in text and "ITL p99: transfer -28.50 ms" in text
    ok = sve.compare(real, figs(11, 31, 4.1, 45, transfer=30.0))
    assert "1 of 1 rows within 10%" in sve.table({"r": ok}, "m")


def test_the_rows_cover_the_issue_and_override_one_base() -> None:
    from cluster.config.serve import ServeConfig

    assert len(sve.ROWS) == 10 and len({r.name for r in sve.ROWS}) == 10
    assert {(r.prefill, r.decode) for r in sve.ROWS} == {(1, 1), (1, 2), (2, 2)}
    assert {r.chunk for r in sve.ROWS} >= {128, 512}
    assert {r.send_policy for r in sve.ROWS} == {"eager", "paced", "at_end"}
    assert {r.policy for r in sve.ROWS} == {"fcfs", "srpt", "wfq"}
    assert {r.load for r in sve.ROWS} == set(sve.RATES) and any(r.prefix for r in sve.ROWS)
    base = ServeConfig.from_dict({})
    for r in sve.ROWS:
        cfg = base.with_values(r.overrides(400.0))
        assert (cfg.pools.prefill_workers, cfg.pools.decode_workers) == (r.prefill, r.decode)
        assert cfg.transfer.send_policy == r.send_policy and cfg.cache.num_blocks == sve.NUM_BLOCKS
        assert (cfg.transfer.rate_gbps is not None) == (r.send_policy == "paced")
        assert (cfg.scheduler.decode_admission == "wfq") == r.tenants
