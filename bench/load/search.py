"""Capacity: the largest concurrency whose closed-loop level meets every target.

A bracketing search: from a starting concurrency, double until a level fails (or halve
until one passes), then bisect between the last pass and the first failure until the
gap is within the resolution. Each probe is a full closed-loop level, and probes are
cached, so the stricter TTFB budgets reuse the levels the main budget already ran.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import msgspec

from bench.load.summary import LevelResult, Slo, budget_key

Probe = Callable[[int], Awaitable[LevelResult]]


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    ttfb_budget_s: float
    concurrency: int
    """Largest passing concurrency found (0: even one stream fails the targets)."""
    at_least: bool
    """True when the search stopped at its maximum without a failure."""
    first_failure: int | None
    """The smallest failing concurrency above the capacity, when one was probed."""
    bounded_by: list[str]
    """Which targets the first failing level missed."""


class SearchResult(msgspec.Struct, frozen=True, kw_only=True):
    capacities: list[Capacity]
    probes: list[int]
    """Concurrencies in the order they were run."""


def failed_targets(result: LevelResult, slo: Slo, ttfb_budget_s: float) -> list[str]:
    """Human-readable reasons a level fails the targets (empty when it passes)."""
    reasons: list[str] = []
    if result.requests == 0:
        reasons.append("no measured request")
    failed = result.requests - result.ok
    if failed:
        reasons.append(f"{failed} failed requests {dict(result.outcomes)}")
    if not result.rtf.p99 < slo.rtf:
        reasons.append(f"p99 RTF {result.rtf.p99:.2f} >= {slo.rtf:g}")
    if not result.ttfb_s.p99 < ttfb_budget_s:
        reasons.append(
            f"p99 TTFB {result.ttfb_s.p99 * 1000:.0f} ms >= {ttfb_budget_s * 1000:.0f} ms"
        )
    if result.underruns:
        reasons.append(f"{result.underruns} underruns in {result.underrun_streams} streams")
    return reasons


class CapacitySearch:
    """Runs probes through ``probe`` and remembers their results."""

    def __init__(self, probe: Probe, slo: Slo, *, resolution: float = 0.1) -> None:
        self._probe = probe
        self._slo = slo
        self._resolution = resolution
        self.results: dict[int, LevelResult] = {}
        self.order: list[int] = []

    async def _passes(self, concurrency: int, budget_s: float) -> bool:
        if concurrency not in self.results:
            self.results[concurrency] = await self._probe(concurrency)
            self.order.append(concurrency)
        return self.results[concurrency].passes[budget_key(budget_s)]

    def _gap_ok(self, lo: int, hi: int) -> bool:
        return hi - lo <= max(1, math.floor(lo * self._resolution))

    async def find(self, budget_s: float, start: int, maximum: int) -> Capacity:
        start = max(1, min(start, maximum))
        lo, hi = 0, None  # lo passes (0 trivially), hi fails
        if await self._passes(start, budget_s):
            lo = start
            while hi is None:
                if lo >= maximum:
                    return self._capacity(budget_s, lo, None, at_least=True)
                c = min(lo * 2, maximum)
                if await self._passes(c, budget_s):
                    lo = c
                else:
                    hi = c
        else:
            hi = start
            while lo == 0 and hi > 1:
                c = hi // 2
                if await self._passes(c, budget_s):
                    lo = c
                else:
                    hi = c
        while lo > 0 and not self._gap_ok(lo, hi):
            mid = (lo + hi) // 2
            if await self._passes(mid, budget_s):
                lo = mid
            else:
                hi = mid
        return self._capacity(budget_s, lo, hi, at_least=False)

    def _capacity(self, budget_s: float, lo: int, hi: int | None, *, at_least: bool) -> Capacity:
        reasons = failed_targets(self.results[hi], self._slo, budget_s) if hi else []
        return Capacity(
            ttfb_budget_s=budget_s,
            concurrency=lo,
            at_least=at_least,
            first_failure=hi,
            bounded_by=reasons,
        )

    async def run(self, start: int, maximum: int) -> SearchResult:
        """Capacity under the main TTFB budget, then under each stricter reported budget
        (searched below the main capacity, which bounds them)."""
        main = await self.find(self._slo.ttfb_s, start, maximum)
        capacities = [main]
        for budget in sorted(b for b in self._slo.ttfb_report_s if b < self._slo.ttfb_s):
            if main.concurrency == 0:
                capacities.append(
                    Capacity(
                        ttfb_budget_s=budget,
                        concurrency=0,
                        at_least=False,
                        first_failure=main.first_failure,
                        bounded_by=main.bounded_by,
                    )
                )
                continue
            strict = await self.find(budget, main.concurrency, main.concurrency)
            if strict.at_least and main.first_failure is not None:
                # Passes at the main capacity; the next level up fails the looser budget,
                # so it fails this one too.
                strict = self._capacity(
                    budget, strict.concurrency, main.first_failure, at_least=False
                )
            capacities.append(strict)
        return SearchResult(capacities=capacities, probes=list(self.order))
