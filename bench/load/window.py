"""The stable window of a load level: which requests count, and over which interval.

A level has three phases. Warm-up: requests scheduled in the first ``warmup_s`` seconds,
and in a closed loop the whole first wave (all N clients start at once, a burst no
steady state has), are not measured. Steady state: requests issued after warm-up, until
the duration or the request budget is spent, are measured. Ramp-down: the generator
keeps offering the same load with *filler* requests until every measured request has
finished, then cancels the fillers; so every measured request runs its whole life under
the offered load, and nothing is measured while the load falls away.

Latency (TTFB, RTF, underruns) comes from the measured requests. Throughput is counted
over the window ``[start + warmup_s, end of the drain]``, during which the offered load
is held: every byte that arrived inside it, from any request (first-wave and filler
requests are part of the load), divided by its length. So a server too slow to finish
one request within the duration still gets a throughput, and a fast one is not credited
for the idle tail.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from bench.load.trace import Outcome, StreamTrace


class TrimPolicy(msgspec.Struct, frozen=True, kw_only=True):
    skip_first: int = 0
    """Requests (by issue order) that are warm-up whatever their time."""
    warmup_s: float = 0.0
    """Requests scheduled earlier than this, from the level's start, are warm-up."""
    duration_s: float
    """Requests scheduled at or after this are fillers."""
    max_requests: int | None = None
    """At most this many measured requests; later ones are fillers."""

    def is_measured(self, index: int, offset_s: float, measured_so_far: int) -> bool:
        if index < self.skip_first or offset_s < self.warmup_s or offset_s >= self.duration_s:
            return False
        return self.max_requests is None or measured_so_far < self.max_requests


class Window(msgspec.Struct, frozen=True):
    start: float
    end: float

    @property
    def length(self) -> float:
        return self.end - self.start


def stable_window(measure_start: float, measure_end: float) -> Window | None:
    """The interval over which the load was held, or None if it is empty."""
    if measure_end <= measure_start:
        return None
    return Window(measure_start, measure_end)


def bytes_in_window(traces: Iterable[StreamTrace], window: Window) -> int:
    """Audio bytes that arrived inside the window, from every request of the level."""
    total = 0
    for trace in traces:
        for t, n in zip(trace.times, trace.sizes, strict=True):
            if window.start <= t <= window.end:
                total += n
    return total


def completions_in_window(traces: Iterable[StreamTrace], window: Window) -> int:
    """Requests of any kind that finished successfully inside the window."""
    return sum(
        1
        for t in traces
        if t.outcome is Outcome.OK and t.done is not None and window.start <= t.done <= window.end
    )


def mean_active(traces: Iterable[StreamTrace], window: Window) -> float:
    """Time-average number of requests in flight inside the window (the load actually held)."""
    if window.length <= 0:
        return 0.0
    busy = 0.0
    for t in traces:
        begin = t.sent if t.sent is not None else t.scheduled
        end = t.done if t.done is not None else window.end
        overlap = min(end, window.end) - max(begin, window.start)
        if overlap > 0:
            busy += overlap
    return busy / window.length
