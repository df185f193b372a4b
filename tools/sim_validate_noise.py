"""What the real side's own noise allows tools/sim_validate.py's table to show.

Each row runs its compared workload ``--fit-runs`` + ``--repeats`` times on the same host,
alternating, so the runs are exchangeable draws of the machine. Two figures from them:

- the **fit runs' oracle**: the fit runs' median as if it were the simulated figure (a
  simulator that reproduced them exactly), against the compared runs' median;
- the **ceiling**: a noise-free simulator exact to the median of all the row's runs,
  against the median of ``repeats`` runs drawn from them (with replacement, seeded): the
  rows it meets the goal on in expectation.

On this 2-vCPU host the compared median of 3 moved enough from run to run that the
ceiling was 6.4-7.1 of 10 rows and the oracle met the goal on 5-8 (val30-32): a count
below those is the model's, the rest is the host's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DRAWS = 2000


def _runs(row: dict, metrics: Sequence[str]) -> tuple[np.ndarray, np.ndarray] | None:
    fit, compared = row.get("fit_runs"), row.get("runs")
    if not fit or not compared:
        return None
    as_array = (lambda runs: np.array([[r[m] for m in metrics] for r in runs],  # noqa: E731
                                      dtype=float))
    return as_array(fit), as_array(compared)


def oracle_rows(rows: Sequence[dict], metrics: Sequence[str], goal: float) -> int | None:
    """Rows where the fit runs' median is within ``goal`` of the compared runs' median on
    every metric; None if no row has both kinds of runs."""
    pairs = [p for r in rows if (p := _runs(r, metrics)) is not None]
    if not pairs:
        return None
    return sum(bool(np.all(np.abs(np.median(f, 0) / np.median(c, 0) - 1) <= goal))
               for f, c in pairs)


def ceiling(rows: Sequence[dict], metrics: Sequence[str], goal: float,
            draws: int = DRAWS, seed: int = 0) -> float | None:
    """The expected number of rows a noise-free simulator exact to the median of all of a
    row's runs of the compared workload meets ``goal`` on, against the median of as many
    runs as the row compared, drawn from them."""
    rng = np.random.default_rng(seed)
    total, seen = 0.0, False
    for r in rows:
        pair = _runs(r, metrics)
        if pair is None:
            continue
        seen = True
        runs = np.concatenate(pair)
        true = np.median(runs, axis=0)
        drawn = np.median(runs[rng.integers(0, len(runs), (draws, len(pair[1])))], axis=1)
        total += float(np.mean(np.all(np.abs(true / drawn - 1) <= goal, axis=1)))
    return total if seen else None


def noise_line(rows: Sequence[dict], metrics: Sequence[str], goal: float) -> str:
    """The two figures as one line of the table's counts ('' for older validations)."""
    top, oracle = ceiling(rows, metrics, goal), oracle_rows(rows, metrics, goal)
    if top is None or oracle is None:
        return ""
    n = sum(_runs(r, metrics) is not None for r in rows)
    return (f"the host's own noise: a noise-free simulator exact to the median of a row's "
            f"real runs would meet {goal:.0%} on {top:.1f} of {n} rows in expectation "
            f"against the median of that many repeats drawn from them; the fit runs' median "
            f"met it on {oracle} of {n} against the compared runs'")
