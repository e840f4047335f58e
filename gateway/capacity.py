"""The node's real-time capacity, learned from the streams it serves.

A stream is real-time while its audio arrives at least as fast as it plays. The gateway sees
every stream's audio arrive (``PcmStream.bytes_received`` and the time of its first chunk),
whatever made it late: the engine's step time at this batch size, a busy codec, CPU
contention between the processes, a LoRA voice. So the gateway measures, per engine:

- the *generation ratio* of its streams: audio seconds that arrived per wall second, from
  each stream's first chunk on (over windows of ``WINDOW_S`` while it streams, and over its
  whole life when it ends; the 10th percentile of a tick's samples);
- the *start time* of its streams: from admission to their first chunk.

Both grow with the number of streams ``n`` on the engine (a decode step serves every running
stream, so its time, and the time per audio second, grows with the batch). ``CapacityModel``
keeps, per ``n`` seen, a moving average of the time per audio second (the inverse of the
generation ratio, the stream's real-time factor) and of the start time, fits a line through
them (weighted least squares, recent buckets weigh more), and takes as the engine's limit the
largest ``n`` whose predicted real-time factor leaves ``margin`` (``1 / (1 + margin)``) and
whose predicted start time is at most half the TTFB budget.

Stability: the limit rises by at most a doubling of the largest load seen real-time (slow
start: every rise is checked by what it brings before the next), and falls only when the fit
is clearly (``FALL_HYSTERESIS``) below it, so that noise between two neighbouring ``n`` does not
make it flap. A limit that holds in real time tries one stream more when the load above it was
last measured ``PROBE_S`` ago (the fit learns only of loads it sees, and the machine may have
changed). It only gates new streams: streams already admitted are never cut.

Why the gateway's measurement and not the engine's step time: on a CPU the codec and the
engine share two cores and the engine's steps stay fast while the codec falls behind; on a
GPU the engine binds. The audio's arrival at the gateway is what the client hears, whichever
it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

WINDOW_S = 0.5
"""A streaming stream gives one generation sample per window of this length."""
HALF_LIFE_S = 60.0
"""A bucket's weight halves every this long without a new sample: the fit follows change."""
MAX_BUCKET_WEIGHT = 8.0
"""Samples a bucket counts at most (a bucket seen for hours does not pin the fit)."""
EWMA_ALPHA = 0.3
FALL_HYSTERESIS = 0.5
"""The limit falls only when the fit is this many streams below it."""
MIN_RATIO = 0.05
"""A stalled stream counts as this slow (a real-time factor of 20), not infinitely."""
WAIT_SHARE = 0.8
"""Of the TTFB budget, what a request may spend waiting for a slot and starting; the rest is
the network's and the first chunk's way to the client's player."""
MIN_WAIT_S = 0.05
"""The shortest wait a request is given (a slot freed at once still reaches it)."""
INITIAL_LIMIT = 2
"""Streams an engine takes before anything is measured (slow start: it doubles as each
load proves real-time)."""
PROBE_S = 120.0
"""A limit held this long without evidence of the load above it tries one stream more (a
probe that proves too slow costs its streams their real time: rarely)."""
PROBE_HOLD_S = 5.0
"""A probe's extra stream is let in for at most this long before its load is measured."""
FRESH_S = 30.0
"""A model with no sample for this long has no opinion on the node's limit."""


@dataclass
class _Bucket:
    value: float
    weight: float
    at: float


@dataclass
class _Series:
    """Moving averages of one quantity per number of streams, and a line through them."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def add(self, n: int, value: float, now: float) -> None:
        b = self.buckets.get(n)
        if b is None:
            self.buckets[n] = _Bucket(value, 1.0, now)
            return
        b.weight = min(MAX_BUCKET_WEIGHT, _decayed(b, now) + 1.0)
        b.value += EWMA_ALPHA * (value - b.value)
        b.at = now

    def largest_n_within(self, bound: float) -> int:
        """The largest n whose bucket's average is within ``bound`` (0: none)."""
        return max((n for n, b in self.buckets.items() if b.value <= bound), default=0)

    def _line(self, now: float) -> tuple[float, float] | None:
        """Intercept and slope of the weighted least-squares line (None: fewer than two
        buckets, or no positive slope)."""
        if len(self.buckets) < 2:
            return None
        sw = sx = sy = sxx = sxy = 0.0
        for n, b in self.buckets.items():
            w = _decayed(b, now)
            sw += w
            sx += w * n
            sy += w * b.value
            sxx += w * n * n
            sxy += w * n * b.value
        det = sw * sxx - sx * sx
        if det <= 1e-12:
            return None
        slope = (sw * sxy - sx * sy) / det
        if slope <= 1e-9:
            return None
        return (sy - slope * sx) / sw, slope

    def predict(self, n: int, now: float) -> float:
        """The value the fit gives at ``n`` (0: no bucket yet)."""
        if not self.buckets:
            return 0.0
        line = self._line(now)
        if line is not None:
            return max(0.0, line[0] + line[1] * n)
        n_top = max(self.buckets)
        return self.buckets[n_top].value * n / n_top

    def solve(self, bound: float, now: float) -> float | None:
        """The n at which the fitted line reaches ``bound`` (None: no bucket yet).

        One bucket, or a fit with no positive slope (noise): the line through the origin and
        the most loaded bucket, which assumes the cost grows in proportion to ``n`` (on a GPU
        it grows slower, so this errs low until a second load is seen).
        """
        if not self.buckets:
            return None
        line = self._line(now)
        if line is not None:
            return (bound - line[0]) / line[1]
        n_top = max(self.buckets)
        top = self.buckets[n_top].value
        return math.inf if top <= 0 else n_top * bound / top


def _decayed(b: _Bucket, now: float) -> float:
    return b.weight * 0.5 ** (max(0.0, now - b.at) / HALF_LIFE_S)


class CapacityModel:
    """The learned stream limit of one engine (see the module docstring)."""

    def __init__(self, *, margin: float, start_budget_s: float, initial: int, upper: int) -> None:
        self.rtf_bound = 1.0 / (1.0 + margin)
        """The real-time factor a stream must stay within (time per audio second)."""
        self.start_budget_s = start_budget_s
        self.upper = upper
        """The configured ceiling (``gateway.max_active_streams``' share)."""
        self.limit = max(1, min(initial, upper))
        self.last_sample_at = -math.inf
        self._probe_at = -math.inf
        """When the limit last tried one stream more (``_should_probe``)."""
        self._rtf = _Series()
        self._start = _Series()

    def observe_ratio(self, n: int, ratio: float, now: float) -> None:
        """Streams on the engine (``n``) generated ``ratio`` audio seconds per second."""
        if n >= 1 and ratio >= 0:
            self._rtf.add(n, 1.0 / max(ratio, MIN_RATIO), now)
            self.last_sample_at = now

    def observe_start(self, n: int, seconds: float, now: float) -> None:
        """A stream started (first audio) ``seconds`` after admission, ``n`` on the engine."""
        if n >= 1 and seconds >= 0:
            self._start.add(n, seconds, now)
            self.last_sample_at = now

    def fresh(self, now: float) -> bool:
        return now - self.last_sample_at <= FRESH_S

    def predicted_start_s(self, n: int, now: float) -> float:
        """The start time the fit predicts at ``n`` streams (0: nothing seen yet)."""
        return self._start.predict(n, now)

    def update(self, now: float) -> int:
        """Refit and move the limit; returns it."""
        probed = self._rtf.buckets.get(self.limit)
        if now - self._probe_at < PROBE_HOLD_S and (probed is None or probed.at < self._probe_at):
            return self.limit  # a probe holds until its load has been measured
        raw = math.inf
        ceiling = self.upper
        for series, bound in ((self._rtf, self.rtf_bound), (self._start, self.start_budget_s)):
            n = series.solve(bound, now)
            if n is None:
                continue
            raw = min(raw, n)
            if good := series.largest_n_within(bound):
                ceiling = min(ceiling, 2 * good)
        if raw == math.inf and ceiling == self.upper:
            return self.limit
        target = max(1, min(ceiling, math.floor(min(raw, ceiling + 1.0))))
        if target > self.limit or raw < self.limit - FALL_HYSTERESIS:
            self.limit = target
        elif self._should_probe(now):
            self.limit += 1
            self._probe_at = now
        return self.limit

    def _should_probe(self, now: float) -> bool:
        """Try one stream more than the limit when the limit is real-time and the load above
        it was last seen ``PROBE_S`` ago or never: what held then may not hold now (another
        process left the machine, shorter texts), and the fit only learns of a load it sees.
        A probe that proves too slow refreshes that load's bucket, so the next one waits."""
        if self.limit >= self.upper:
            return False
        at = self._rtf.buckets.get(self.limit)
        if at is None or at.value > self.rtf_bound or now - at.at > FRESH_S:
            return False
        above = self._rtf.buckets.get(self.limit + 1)
        return above is None or now - above.at > PROBE_S


class _Tracked:
    __slots__ = ("load", "mark_bytes", "mark_t", "started", "stream", "ticks", "windows")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.started = False
        self.mark_t = 0.0
        self.mark_bytes = 0
        self.windows = 0
        self.load = 0
        """The engine's streams, summed over the ticks of the current window."""
        self.ticks = 0


class Stream(Protocol):
    """What the controller reads of a stream (``gateway.streams.PcmStream``)."""

    engine: int
    opened_at: float
    first_audio_at: float | None
    first_chunk_bytes: int
    bytes_received: int
    last_record_at: float
    text_closed: bool

    @property
    def ended(self) -> bool: ...


class CapacityController:
    """Feeds each engine's ``CapacityModel`` from the streams of one gateway process.

    ``tick`` (every ``TICK_S``, from the gateway's watchdog) walks the open streams: a stream's
    first audio gives a start sample, each ``WINDOW_S`` of its audio a generation sample, and
    its end (``END``, not a failure) one over what was left. The samples of one tick are one
    observation per engine (their 10th percentile: the slow streams decide), made at the
    node's number of streams on that engine. A stream whose text is still open (ZeroMQ
    ``text_open``) waits on its client, not on the engines, and gives no generation samples.
    """

    def __init__(
        self,
        engines: int,
        *,
        margin: float,
        ttfb_budget_s: float,
        initial: int,
        upper: int,
        bytes_per_second: int,
    ) -> None:
        self.ttfb_budget_s = ttfb_budget_s
        self.models = [
            CapacityModel(
                margin=margin, start_budget_s=ttfb_budget_s / 2, initial=initial, upper=upper
            )
            for _ in range(engines)
        ]
        self._bps = float(bytes_per_second)
        self._tracked: dict[Stream, _Tracked] = {}
        """Keyed by the stream itself: a request of several runs of text (break tags)
        changes its stream id between runs (``StreamRegistry.reopen``), not its stream."""
        self._ratios: list[list[tuple[float, float]]] = [[] for _ in range(engines)]
        """This tick's generation samples per engine: (ratio, the window's average load)."""
        self._starts: list[list[float]] = [[] for _ in range(engines)]

    def tick(self, streams: Iterable[Stream], node_by_engine: list[int], now: float) -> list[int]:
        """Take this tick's samples; returns each engine's opinion (0: no fresh evidence)."""
        tracked = self._tracked
        engines = len(self.models)
        loads = [
            max(1, node_by_engine[e] if e < len(node_by_engine) else 1) for e in range(engines)
        ]
        seen = set()
        for s in streams:
            seen.add(s)
            t = tracked.get(s)
            if t is None:
                t = tracked[s] = _Tracked(s)
            if s.engine < engines:
                t.load += loads[s.engine]
                t.ticks += 1
            self._sample(t, now)
        for s in [s for s in tracked if s not in seen]:
            t = tracked.pop(s)
            if s.ended:
                self._sample(t, s.last_record_at, final=True)
        opinions = []
        for e, model in enumerate(self.models):
            ratios, starts = self._ratios[e], self._starts[e]
            if ratios:
                # The slow streams decide; each window's load is its own average (a window
                # spans several ticks, over which the engine's streams came and went).
                ratios.sort()
                ratio, _ = ratios[len(ratios) // 10]
                n = round(sum(load for _, load in ratios) / len(ratios))
                model.observe_ratio(max(1, n), ratio, now)
                ratios.clear()
            if starts:
                starts.sort()
                model.observe_start(loads[e], starts[(len(starts) * 9) // 10], now)
                starts.clear()
            limit = model.update(now)
            opinions.append(limit if model.fresh(now) else 0)
        return opinions

    def _sample(self, t: _Tracked, now: float, *, final: bool = False) -> None:
        s = t.stream
        first = s.first_audio_at
        if first is None or s.engine >= len(self.models):
            return
        if not t.started:
            t.started = True
            self._starts[s.engine].append(first - s.opened_at)
            t.mark_t, t.mark_bytes = first, s.first_chunk_bytes
        if not s.text_closed:
            t.mark_t, t.mark_bytes = now, s.bytes_received  # waiting on its client
            t.load = t.ticks = 0
            return
        # Windows run from one chunk's arrival to another's (the audio counted arrived by
        # ``last_record_at``), so that chunks of several frames do not quantise the rate;
        # a stream that received nothing for a window is stalled, and its wait counts.
        end = s.last_record_at if now - s.last_record_at <= WINDOW_S else now
        span = end - t.mark_t
        if span >= WINDOW_S or (final and (t.windows == 0 or span >= WINDOW_S / 2) and span > 0):
            audio_s = (s.bytes_received - t.mark_bytes) / self._bps
            load = t.load / t.ticks if t.ticks else 1.0
            self._ratios[s.engine].append((audio_s / span, load))
            t.mark_t, t.mark_bytes = end, s.bytes_received
            t.load = t.ticks = 0
            t.windows += 1

    def wait_budget_s(self, node_by_engine: list[int], now: float) -> float:
        """How long a request may wait for a slot and still start within the TTFB budget:
        ``WAIT_SHARE`` of the budget less the start time the least loaded engine's fit
        predicts."""
        start = min(
            (
                m.predicted_start_s(max(1, n), now)
                for m, n in zip(self.models, node_by_engine, strict=False)
            ),
            default=0.0,
        )
        return max(MIN_WAIT_S, WAIT_SHARE * self.ttfb_budget_s - start)
