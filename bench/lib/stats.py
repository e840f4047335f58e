"""The one percentile of every benchmark, and the distribution summary of the load results."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics.

    Same definition as ``numpy.percentile(..., method="linear")``: the value at rank
    ``(n - 1) * q / 100`` of the sorted data, interpolated between its two neighbours.
    An empty input has no percentile: ``nan``.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if len(values) == 0:
        return math.nan
    data = sorted(values)
    rank = (len(data) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(data) - 1)
    frac = rank - lo
    return data[lo] + (data[hi] - data[lo]) * frac


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """Distribution of one per-stream quantity over the measured streams."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            nan = math.nan
            return cls(n=0, mean=nan, p50=nan, p90=nan, p99=nan, max=nan)
        return cls(
            n=len(values),
            mean=math.fsum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            max=max(values),
        )
