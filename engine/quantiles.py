"""Percentiles: the one definition used by the router, the benches and the reports.

Linear interpolation between the two nearest ranks, numpy's default ``method="linear"``
(Hyndman & Fan type 7): for ``n`` sorted values ``x``, the ``q``-th percentile sits at
the virtual index ``i = (n - 1) * q / 100`` and is ``x[floor(i)]`` moved towards
``x[floor(i) + 1]`` by the fraction ``i - floor(i)``. The arithmetic is numpy's to the
bit (the same lerp, from whichever end is nearer), so figures computed here equal
``numpy.percentile``'s. A NaN in the sample makes the result NaN, as in numpy.

Plain Python on purpose: the router calls it on a few hundred gaps at a time, and the
engine stays free of heavier imports.

    percentile([1, 2, 3, 4], 90)          # 3.7
    percentiles(gaps, (50, 90, 99))       # {50.0: ..., 90.0: ..., 99.0: ...}, one sort
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def _check_q(q: float) -> float:
    q = float(q)
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return q


def _sorted_sample(values: Iterable[float]) -> list[float]:
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("percentile of an empty sample")
    return xs


def _at(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of the sorted, NaN-free, non-empty ``xs``."""
    virtual = (len(xs) - 1) * (q / 100.0)
    lo = math.floor(virtual)
    hi = min(lo + 1, len(xs) - 1)
    t = virtual - lo
    a, b = xs[lo], xs[hi]
    diff = b - a
    return b - diff * (1.0 - t) if t >= 0.5 else a + diff * t  # numpy's _lerp


def percentiles(values: Iterable[float], qs: Iterable[float]) -> dict[float, float]:
    """``{q: percentile}`` for every ``q`` in ``qs`` (percent, 0..100), sorting once.

    Raises ``ValueError`` for an empty sample or a ``q`` outside [0, 100].
    """
    checked = [_check_q(q) for q in qs]
    xs = _sorted_sample(values)
    if any(math.isnan(x) for x in xs):
        return dict.fromkeys(checked, math.nan)
    return {q: _at(xs, q) for q in checked}


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (percent, 0..100) of ``values``, linearly interpolated."""
    return percentiles(values, (q,))[_check_q(q)]


def median(values: Iterable[float]) -> float:
    """The 50th percentile (for an even count: the mean of the two middle values)."""
    return percentile(values, 50.0)
