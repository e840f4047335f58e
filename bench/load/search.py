"""Capacity search: which closed-loop levels to measure so that every criterion's boundary is
bracketed within the resolution.

For each criterion (bench.load.criteria) in turn, the bracket is read off every level
measured so far: ``lo`` the largest passing level, ``hi`` the smallest failing level above
it. With no level yet, the start level is measured. Then the search doubles ``lo`` until a
level fails (or halves ``hi`` until one passes), and bisects until ``hi - lo`` is within the
resolution. Levels are cached, so a criterion whose boundary the earlier ones already
bracketed costs nothing: the real-time criterion is searched first (from the start level),
then the published one (usually looser: it goes on upwards from there), then the
interactive one (stricter than real-time: usually bracketed already, or a level or two of
bisection below it).

The capacities reported are those of :func:`bench.load.criteria.capacities_of` over every
measured level: the largest measured passing level, never an extrapolation.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import msgspec

from bench.load.criteria import (
    CRITERIA,
    Capacity,
    Criterion,
    CriterionName,
    capacities_of,
    criterion,
    passes,
)
from bench.load.summary import LevelResult, Slo

Probe = Callable[[int], Awaitable[LevelResult]]

SEARCH_ORDER: tuple[CriterionName, ...] = ("real-time", "published", "interactive")


class SearchResult(msgspec.Struct, frozen=True, kw_only=True):
    capacities: list[Capacity]
    """One per criterion, in the order published, real-time, interactive."""
    probes: list[int]
    """Concurrencies in the order they were run (the warm-up level is not one of them)."""


class CapacitySearch:
    """Runs probes through ``probe`` and remembers their results."""

    def __init__(self, probe: Probe, slo: Slo, *, resolution: float = 0.1) -> None:
        self._probe = probe
        self._slo = slo
        self._resolution = resolution
        self.results: dict[int, LevelResult] = {}
        self.order: list[int] = []

    async def _measure(self, concurrency: int) -> None:
        if concurrency not in self.results:
            self.results[concurrency] = await self._probe(concurrency)
            self.order.append(concurrency)

    def _bracket(self, crit: Criterion, maximum: int) -> tuple[int, int | None]:
        ok = [c for c, r in self.results.items() if c <= maximum and passes(r, crit)]
        lo = max(ok, default=0)
        above = [c for c, r in self.results.items() if c > lo and not passes(r, crit)]
        return lo, min(above, default=None)

    def _gap_ok(self, lo: int, hi: int) -> bool:
        return hi - lo <= max(1, math.floor(lo * self._resolution))

    async def bracket(self, crit: Criterion, start: int, maximum: int) -> None:
        """Measure levels until ``crit``'s boundary is bracketed within the resolution, the
        maximum passes, or one stream fails."""
        lo, hi = self._bracket(crit, maximum)
        if lo == 0 and hi is None:
            await self._measure(max(1, min(start, maximum)))
            lo, hi = self._bracket(crit, maximum)
        while hi is None and lo < maximum:  # passing: double
            await self._measure(min(lo * 2, maximum))
            lo, hi = self._bracket(crit, maximum)
        while lo == 0 and hi is not None and hi > 1:  # failing: halve
            await self._measure(hi // 2)
            lo, hi = self._bracket(crit, maximum)
        while lo > 0 and hi is not None and not self._gap_ok(lo, hi):
            await self._measure((lo + hi) // 2)
            lo, hi = self._bracket(crit, maximum)

    async def find(self, name: CriterionName, start: int, maximum: int) -> Capacity:
        crit = criterion(name, self._slo)
        await self.bracket(crit, start, maximum)
        return self.capacities()[CRITERIA.index(name)]

    def capacities(self) -> list[Capacity]:
        return capacities_of(list(self.results.values()), self._slo)

    async def run(self, start: int, maximum: int) -> SearchResult:
        for name in SEARCH_ORDER:
            await self.bracket(criterion(name, self._slo), start, maximum)
        return SearchResult(capacities=self.capacities(), probes=list(self.order))
