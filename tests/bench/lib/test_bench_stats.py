"""Percentiles and summaries against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.lib.stats import Summary, percentile


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # rank 1.5: halfway between 2 and 3
        ([1.0, 2.0, 3.0, 4.0], 90, 3.7),  # rank 2.7
        ([1.0, 2.0, 3.0, 4.0], 99, 3.97),  # rank 2.97
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([4.0, 1.0, 3.0, 2.0], 50, 2.5),  # order of the input does not matter
        ([10.0, 20.0], 25, 12.5),
        ([7.0], 99, 7.0),
        ([float(i) for i in range(1, 101)], 99, 99.01),  # rank 98.01 of 1..100
    ],
)
def test_percentile_hand_computed(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def test_percentile_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(0, 100),
)
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    expected = float(np.percentile(values, q, method="linear"))
    assert percentile(values, q) == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_percentile_of_an_array() -> None:
    assert percentile(np.array([4.0, 1.0, 3.0, 2.0]), 50) == pytest.approx(2.5)
    assert math.isnan(percentile(np.array([]), 50))


def test_summary_hand_computed() -> None:
    s = Summary.of([0.1, 0.2, 0.3, 0.4, 1.0])
    assert s.n == 5
    assert s.mean == pytest.approx(0.4)
    assert s.p50 == pytest.approx(0.3)
    assert s.p90 == pytest.approx(0.76)  # rank 3.6: 0.4 + 0.6 * (1.0 - 0.4)
    assert s.p99 == pytest.approx(0.976)  # rank 3.96
    assert s.max == 1.0


def test_summary_of_nothing() -> None:
    s = Summary.of([])
    assert s.n == 0 and math.isnan(s.p99)
