"""tools/sim_validate_report.py: what the real runs' own spread lets the validation show."""

from __future__ import annotations

import pytest

from tools.sim_validate_report import ceiling, noise_line, oracle_rows

M = ("a", "b")


def _row(fit: list[float], compared: list[float]) -> dict:
    as_runs = (lambda xs: [{"a": x, "b": 1.0} for x in xs])  # noqa: E731
    return {"fit_runs": as_runs(fit), "runs": as_runs(compared)}


def test_runs_that_never_move_allow_every_row_and_the_oracle_meets_them_all() -> None:
    rows = [_row([5.0, 5.0, 5.0], [5.0, 5.0, 5.0])] * 4
    assert ceiling(rows, M, 0.1) == pytest.approx(4.0)
    assert oracle_rows(rows, M, 0.1) == 4


def test_a_row_whose_runs_move_by_half_is_rarely_met_and_its_oracle_misses() -> None:
    steady, noisy = _row([5.0] * 3, [5.0] * 3), _row([4.0, 6.0, 9.0], [3.0, 7.0, 10.0])
    top = ceiling([steady, noisy], M, 0.1)
    assert 1.0 < top < 1.5  # the steady row always, the noisy one seldom
    assert ceiling([steady, noisy], M, 0.1) == top  # seeded: the same figure each time
    assert oracle_rows([steady, noisy], M, 0.1) == 1  # 6.0 against 7.0
    # the fit runs of another level than the compared ones: the oracle misses, the
    # ceiling (all runs pooled, exchangeable) does not tell them apart
    assert oracle_rows([_row([5.0] * 3, [6.0] * 3)], M, 0.1) == 0


def test_older_validations_without_fit_runs_print_no_noise_line() -> None:
    assert noise_line([{"runs": [{"a": 1.0, "b": 1.0}]}], M, 0.1) == ""
    assert ceiling([], M, 0.1) is None and oracle_rows([], M, 0.1) is None
    line = noise_line([_row([5.0] * 3, [5.0] * 3)], M, 0.1)
    assert "on 1.0 of 1 rows in expectation" in line and "met it on 1 of 1" in line
