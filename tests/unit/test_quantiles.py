"""engine.quantiles: the one percentile, equal to numpy's default (linear) to the bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.quantiles import median, percentile, percentiles

finite = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False, allow_infinity=False)
samples = st.lists(finite | st.integers(-1000, 1000), min_size=1, max_size=60)
qs = st.floats(min_value=0.0, max_value=100.0) | st.sampled_from([0, 50, 90, 95, 99, 99.9, 100])


@settings(max_examples=400, deadline=None)
@given(samples, qs)
def test_percentile_equals_numpys_linear_method_exactly(values, q) -> None:
    assert percentile(values, q) == float(np.percentile(np.asarray(values, dtype=float), q))


@settings(max_examples=100, deadline=None)
@given(samples, st.lists(qs, min_size=1, max_size=5))
def test_percentiles_sort_once_and_agree_with_percentile(values, many) -> None:
    got = percentiles(values, many)
    assert got == {float(q): percentile(values, q) for q in many}


def test_known_values_and_edges() -> None:
    x = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(x, 90) == pytest.approx(3.7) and percentile(x, 99) == pytest.approx(3.97)
    assert (percentile(x, 0), percentile(x, 100)) == (1.0, 4.0)
    assert median(x) == 2.5 and median([7]) == 7.0 and percentile([7], 99) == 7.0
    assert median(iter([3, 1, 2])) == 2.0  # any iterable


def test_nan_propagates_like_numpy() -> None:
    assert math.isnan(percentile([1.0, float("nan"), 3.0], 50))
    assert math.isnan(float(np.percentile([1.0, float("nan"), 3.0], 50)))


@pytest.mark.parametrize("values,q,match", [([], 50, "empty"), ([1.0], -1, r"\[0, 100\]"),
                                            ([1.0], 100.5, r"\[0, 100\]")])
def test_bad_input_names_the_problem(values, q, match) -> None:
    with pytest.raises(ValueError, match=match):
        percentile(values, q)
