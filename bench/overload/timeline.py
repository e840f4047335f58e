"""What happened over an arm's run, second by second: the server's limit and active streams
(scraped from ``GET /metrics``) and the streams' audio lead over their players (from the
client's traces).

All times are ``time.perf_counter()`` seconds, on the clock of the traces; the report
stores them relative to the arm's start.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Iterable, Sequence
from itertools import accumulate
from types import TracebackType
from typing import Self

import aiohttp
import msgspec

from bench.lib.stats import percentile
from bench.load.trace import StreamTrace, audio_seconds

GAUGES = (
    "orpheus_gateway_capacity",
    "orpheus_gateway_active_streams",
    "orpheus_gateway_queued_streams",
    "orpheus_gateway_saturation",
)
"""Node-wide gauges of gateway/metrics.py the timeline follows; one a server lacks (the
learned capacity on a server without it) is simply absent from the samples."""


def parse_gauges(text: str, names: Iterable[str]) -> dict[str, float]:
    """The sum over label sets of each named sample in a Prometheus text exposition;
    names with no sample are left out."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        if line[:end] not in wanted:
            continue
        rest = line.rsplit("}", 1)[1] if line[end] == "{" else line[end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        out[line[:end]] = out.get(line[:end], 0.0) + value
    return out


class Scrape(msgspec.Struct, frozen=True, array_like=True):
    t: float
    values: dict[str, float]


class MetricsScraper:
    """Reads the gauges every ``interval_s`` while it is entered (an asyncio task)."""

    def __init__(self, url: str, names: Sequence[str] = GAUGES, *, interval_s: float = 0.5) -> None:
        self._url = url.rstrip("/") + "/metrics"
        self._names = tuple(names)
        self._interval_s = interval_s
        self.scrapes: list[Scrape] = []
        self.errors = 0
        """Scrapes that failed (no answer within the interval, a non-200)."""
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(self._interval_s, 2.0))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            next_at = time.perf_counter()
            while True:
                t = time.perf_counter()
                try:
                    async with session.get(self._url) as resp:
                        if resp.status == 200:
                            values = parse_gauges(await resp.text(), self._names)
                            self.scrapes.append(Scrape(t, values))
                        else:
                            self.errors += 1
                except (aiohttp.ClientError, TimeoutError):
                    self.errors += 1
                next_at += self._interval_s
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def series(self, t0: float) -> dict[str, list[list[float]]]:
        """Per gauge, ``[t - t0, value]`` pairs."""
        out: dict[str, list[list[float]]] = {}
        for s in self.scrapes:
            for name, value in s.values.items():
                out.setdefault(name, []).append([s.t - t0, value])
        return out


class LeadSample(msgspec.Struct, frozen=True, kw_only=True):
    t: float
    streams: int
    """Streams playing (first byte arrived, last byte not yet) at ``t``."""
    p50_s: float
    min_s: float


def lead_at(
    times: Sequence[float], received: Sequence[int], t: float, jitter_buffer_s: float
) -> float:
    """Audio seconds a stream's player holds at ``t``: received by then minus played by then,
    on the fixed playback clock of bench.load.playback (negative: it has run dry).
    ``received[i]``: bytes received up to and including ``times[i]``; ``t >= times[0]``."""
    i = bisect.bisect_right(times, t)
    played = max(0.0, t - (times[0] + jitter_buffer_s))
    return audio_seconds(received[i - 1]) - played


def lead_series(
    traces: Iterable[StreamTrace], ticks: Sequence[float], jitter_buffer_s: float
) -> list[LeadSample]:
    """At each tick (sorted), the median and the smallest lead over the streams playing."""
    leads: list[list[float]] = [[] for _ in ticks]
    for trace in traces:
        if not trace.times:
            continue
        received = list(accumulate(trace.sizes))
        lo = bisect.bisect_left(ticks, trace.times[0])
        hi = bisect.bisect_right(ticks, trace.times[-1])
        for k in range(lo, hi):
            leads[k].append(lead_at(trace.times, received, ticks[k], jitter_buffer_s))
    return [
        LeadSample(t=t, streams=len(values), p50_s=percentile(values, 50), min_s=min(values))
        for t, values in zip(ticks, leads, strict=True)
        if values
    ]


def ticks(start: float, end: float, interval_s: float) -> list[float]:
    n = max(0, int((end - start) / interval_s) + 1)
    return [start + k * interval_s for k in range(n)]
