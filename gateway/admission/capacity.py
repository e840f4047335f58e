"""The node's real-time capacity, learned from the streams it serves.

A stream is real-time while its audio arrives at least as fast as it plays. The gateway sees
every stream's audio arrive (``PcmStream.bytes_received`` and the time of its first chunk),
whatever made it late: the engine's step time at this batch size, a busy codec, CPU
contention between the processes, a LoRA voice. So the gateway measures, per engine:

- the *generation ratio* of its streams: audio seconds that arrived per wall second, from
  each stream's first chunk on (over windows of ``WINDOW_S`` while it streams, and over its
  whole life when it ends; the 10th percentile of a tick's samples);
- the *start time* of its streams: from admission to their first chunk;
- whether each stream *underran*: its *lead* (the audio it had received less the time since
  its first audio, taken just before each chunk arrived: what a player that started at the
  first chunk still held) went below ``-UNDERRUN_S``.

The first two grow with the number of streams ``n`` on the engine (a decode step serves every
running stream, so its time, and the time per audio second, grows with the batch).
``CapacityModel`` keeps, per ``n`` seen, a moving average of the time per audio second (the
inverse of the generation ratio, the stream's real-time factor) and of the start time, fits a
line through them (weighted least squares, recent buckets weigh more), and takes as the
engine's limit the largest ``n`` whose predicted real-time factor leaves ``margin``
(``1 / (1 + margin)``) and whose predicted start time is at most half the TTFB budget.

The rate alone does not decide: a stream plays without a gap only if each chunk comes before
its player runs out of the audio before it, and the first chunks of a stream carry little
audio, so a load can keep its rate well above real time on average and still leave its
streams' players dry early on (docs/performance.md, the overload diagnosis: its table of
rates and underruns by load). So a load at which clearly more than
``MAX_UNDERRUN_SHARE`` of the streams underran is *bad*, as is one whose measured real-time
factor or start time is past its bound; a bad load bounds the limit below it
for ``BAD_MEMORY_S``, doubled each time it is tried and found bad again.

Stability: the limit rises by at most ``GROWTH`` times the largest load seen real-time, and
past a load only once ``PROVE_STREAMS`` of its streams ended real-time (slow start: every rise
is checked by what it brings before the next), never to a load found bad lately, and falls
at once when a load at or below it is found bad; otherwise it falls only when the fit is clearly (``FALL_HYSTERESIS``) below it, so that noise between two
neighbouring ``n`` does not make it flap, and never on one load's extrapolation (a line through
the origin is wrong wherever the step has a fixed cost). A limit that holds in real time tries
one stream more when the load above it was last measured ``PROBE_S`` ago (the fit learns only
of loads it sees, and the machine may have changed). It only gates new streams: streams
already admitted are never cut.

Why the gateway's measurement and not the engine's step time: on a CPU the codec and the
engine share two cores and the engine's steps stay fast while the codec falls behind; on a
GPU the engine binds. The audio's arrival at the gateway is what the client hears, whichever
it is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

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
"""Streams an engine takes before anything is measured (slow start: it grows by ``GROWTH`` as
each load proves real-time)."""
PROBE_S = 120.0
"""A limit held this long without evidence of the load above it tries one stream more (a
probe that proves too slow costs its streams their real time: rarely)."""
BAD_MEMORY_S = 15.0
"""A load found bad bounds the limit below it this long after its last measurement, doubled
each time it is tried again and found bad again, up to ``PROBE_S`` (a backoff: a transient,
such as the first streams of a cold server, costs seconds; a load the node does not hold is
tried rarely); reset once the limit has gone past it."""
PROBE_HOLD_S = 5.0
"""A probe's extra stream is let in for at most this long before its load is measured."""
FRESH_S = 30.0
"""A model with no sample for this long has no opinion on the node's limit."""
UNDERRUN_S = 0.1
"""A stream whose lead fell below minus this underran: a player that starts after a 100 ms
jitter buffer would have run dry (the definition of real time ``bench overload`` measures)."""
MAX_UNDERRUN_SHARE = 0.05
"""A load at which more than this share of the streams underran is bad (the goal: 95% of the
streams real-time)."""
PROVE_STREAMS = 8
"""The limit goes past a load only once at least this many of its streams ended (recently),
so few of them underrun that the share's upper bound (``VERDICT_Z``) is within
``PROVE_SHARE`` (8 streams with no underrun, 16 with one): the rate of the first seconds says
nothing of the gaps a load leaves, and a load that leaves 40% of its players dry passes 8
streams with one underrun one time in ten."""
PROVE_SHARE = 0.2
MIN_UNDERRUNS = 1.5
"""A verdict needs two underruns (decayed): one stream's gap may be its own (a long text's
first chunk), not its load's."""
VERDICT_Z = 1.28
"""A load is bad when the lower bound of the share of its streams that underran (Wilson score,
one-sided 90%) is above ``MAX_UNDERRUN_SHARE``: 2 of 4 streams is a verdict, 2 of 19 (a load
that plays ~97% of its streams real-time having a bad minute) is not."""
VERDICT_WEIGHT = 3.0
"""A load is bad on its rate or start time only once its bucket holds this many samples: one
tick's windows are a few chunks of a few streams, and a codec that sends in bursts makes
single windows noisy."""
GROWTH = 1.5
"""The limit rises to at most this times the largest load measured good (at least one more):
slow start, each rise checked by what it brings before the next."""


@dataclass
class _Bucket:
    value: float
    weight: float
    at: float


@dataclass
class _Ends:
    """The streams that ended at one load, and those of them that underran (decayed)."""

    streams: float
    underran: float
    at: float

    def add(self, underran: bool, now: float) -> None:
        decay = 0.5 ** (max(0.0, now - self.at) / HALF_LIFE_S) if now - self.at <= PROBE_S else 0.0
        self.streams = self.streams * decay + 1.0
        self.underran = self.underran * decay + (1.0 if underran else 0.0)
        self.at = now

    @property
    def bad(self) -> bool:
        return self.underran >= MIN_UNDERRUNS and (
            _wilson(self.underran, self.streams, VERDICT_Z)[0] > MAX_UNDERRUN_SHARE
        )

    @property
    def good(self) -> bool:
        return (
            self.streams >= PROVE_STREAMS
            and _wilson(self.underran, self.streams, VERDICT_Z)[1] <= PROVE_SHARE
        )


def _wilson(hits: float, n: float, z: float) -> tuple[float, float]:
    """The Wilson score interval of a share ``hits / n``: (lower, upper)."""
    if n <= 0:
        return 0.0, 1.0
    p = min(1.0, hits / n)
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (centre - spread) / (1 + z2 / n), (centre + spread) / (1 + z2 / n)


@dataclass
class _Series:
    """Moving averages of one quantity per number of streams, and a line through them."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def add(self, n: int, value: float, now: float) -> None:
        b = self.buckets.get(n)
        if b is None or now - b.at > PROBE_S:  # stale: measured afresh, not averaged in
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
        """The n at which the fitted line reaches ``bound`` (None: fewer than two buckets,
        or a fit with no positive slope: the measured buckets and the slow start decide)."""
        line = self._line(now)
        if line is None:
            return None
        return (bound - line[0]) / line[1]

    def bad(self, bound: float, what: str) -> Iterable[tuple[int, float, str]]:
        """Each n whose bucket (of ``VERDICT_WEIGHT`` samples or more) is past ``bound``:
        (n, when last measured, why)."""
        for n, b in self.buckets.items():
            if b.value > bound and b.weight >= VERDICT_WEIGHT:
                yield n, b.at, f"{what} {b.value:.2f} > {bound:.2f}"


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
        self._ends: dict[int, _Ends] = {}
        self._memory: dict[int, float] = {}
        """Load -> how long its last bad verdict bounds the limit (``BAD_MEMORY_S``)."""
        self.changes = 0
        self._fell_at = -math.inf
        """How often the limit moved (the controller logs each move with ``reason``)."""
        self.reason = "nothing measured yet"

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

    def observe_end(self, n: int, underran: bool, now: float) -> None:
        """A stream that ran at ``n`` streams on average ended; whether its player ran dry."""
        if n >= 1:
            ends = self._ends.get(n)
            if ends is None:
                self._ends[n] = _Ends(1.0, 1.0 if underran else 0.0, now)
            else:
                ends.add(underran, now)
            self.last_sample_at = now

    def lowest_bad(self) -> tuple[int, float, str] | None:
        """The smallest load found bad by any of the three measures as last measured: (n,
        when, why). Within its memory (``BAD_MEMORY_S``, doubled at each verdict) of ``when``
        the limit stays below it; after, it may try it again (and no further until it is
        measured good)."""
        bad = [
            *self._rtf.bad(self.rtf_bound, "real-time factor"),
            *self._start.bad(self.start_budget_s, "start s"),
            *(
                (n, e.at, f"{e.underran:.1f} of {e.streams:.1f} streams underran")
                for n, e in self._ends.items()
                if e.bad
            ),
        ]
        return min(bad, default=None)

    def fresh(self, now: float) -> bool:
        return now - self.last_sample_at <= FRESH_S

    def below_one(self, now: float) -> float | None:
        """The part of one stream the engine holds in real time while one stream is too many
        for it (load 1 found bad lately), else None: the measure that found it bad says how
        short it falls (the real-time factor's bound over the one measured, else the start
        budget over the start time, else the share of its streams that played without a
        gap)."""
        bad = self.lowest_bad()
        if bad is None or bad[0] != 1 or now - bad[1] >= self._memory.get(1, BAD_MEMORY_S):
            return None
        rtf, start, ends = self._rtf.buckets.get(1), self._start.buckets.get(1), self._ends.get(1)
        if rtf is not None and rtf.value > self.rtf_bound:
            held = self.rtf_bound / rtf.value
        elif start is not None and start.value > self.start_budget_s:
            held = self.start_budget_s / start.value
        elif ends is not None and ends.bad:
            held = 1.0 - ends.underran / ends.streams
        else:
            held = 1.0
        return round(held, 2)

    def predicted_start_s(self, n: int, now: float) -> float:
        """The start time the fit predicts at ``n`` streams (0: nothing seen yet)."""
        return self._start.predict(n, now)

    def update(self, now: float) -> int:
        """Refit and move the limit; returns it."""
        probed = self._rtf.buckets.get(self.limit)
        if now - self._probe_at < PROBE_HOLD_S and (probed is None or probed.at < self._probe_at):
            return self.limit  # a probe holds until its load has been measured
        if not self._rtf.buckets and not self._start.buckets:
            return self.limit
        raw = math.inf
        ceiling = self.upper
        for series, bound in ((self._rtf, self.rtf_bound), (self._start, self.start_budget_s)):
            if not series.buckets:
                continue
            n = series.solve(bound, now)
            if n is not None:
                raw = min(raw, n)
            good = max(1, series.largest_n_within(bound))
            ceiling = min(ceiling, max(good + 1, math.ceil(GROWTH * good)))
        bad = self.lowest_bad()
        memory = self._memory.get(bad[0], BAD_MEMORY_S) if bad is not None else 0.0
        recent = bad is not None and now - bad[1] < memory
        if bad is not None:
            ceiling = max(1, min(ceiling, bad[0] - 1 if recent else bad[0]))
        target = max(1, min(ceiling, math.floor(min(raw, ceiling + 1.0))))
        before = self.limit
        if bad is not None and recent and bad[0] <= self.limit:
            self.limit = target  # evidence: at once (the ceiling is below the bad load)
            known = self._memory.get(bad[0])
            self._memory[bad[0]] = BAD_MEMORY_S if known is None else min(PROBE_S, 2 * known)
            self.reason = (
                f"{bad[0]} streams too many: {bad[2]}; not tried again for"
                f" {self._memory[bad[0]]:.0f} s"
            )
        elif target > self.limit and self._proven(self.limit, now) and self._settled(now):
            self.limit = target
            self.reason = "the fit and the loads measured real-time allow it"
        elif raw < self.limit - FALL_HYSTERESIS:
            self.limit = target
            self.reason = f"the fit reaches the bounds at {raw:.1f} streams"
        elif self._settled(now) and self._should_probe(now, bad, recent):
            self.limit += 1
            self._probe_at = now
            self.reason = f"a probe: {self.limit} streams not measured lately"
        if self.limit != before:
            self.changes += 1
            if self.limit < before:
                self._fell_at = now
            if self.limit > before and self.limit in self._memory:
                # Tried again after its verdict expired: measured afresh, not averaged with
                # the evidence that made it bad, and held like a probe until measured.
                for series in (self._rtf.buckets, self._start.buckets, self._ends):
                    series.pop(self.limit, None)
                self._probe_at = now
            for n in [n for n in self._memory if n < self.limit]:
                del self._memory[n]  # gone past: measured good since
        return self.limit

    def _settled(self, now: float) -> bool:
        """No fall in the last ``BAD_MEMORY_S``: a limit that just fell (the fit dipped, a load
        was found bad) does not rise or probe again at once, which would flip between two
        neighbouring loads on every noisy tick."""
        return now - self._fell_at >= BAD_MEMORY_S

    def _proven(self, n: int, now: float) -> bool:
        """At least ``PROVE_STREAMS`` streams have ended at load ``n`` lately, few enough of
        them underrun: the limit may go past ``n``."""
        e = self._ends.get(n)
        return e is not None and e.good and now - e.at <= FRESH_S

    def _should_probe(self, now: float, bad: tuple[int, float, str] | None, recent: bool) -> bool:
        """Try one stream more than the limit when the limit is real-time and the load above
        it is bad with its verdict expired (``BAD_MEMORY_S``), or was last seen ``PROBE_S``
        ago or never: what held then may not hold now (another process left the machine,
        shorter texts), and the fit only learns of a load it sees."""
        if self.limit >= self.upper or not self._proven(self.limit, now):
            return False
        at = self._rtf.buckets.get(self.limit)
        if at is None or at.value > self.rtf_bound or now - at.at > FRESH_S:
            return False
        above = self.limit + 1
        if bad is not None and bad[0] == above:
            return not recent
        measured = [b.at for b in (self._rtf.buckets.get(above), self._ends.get(above)) if b]
        return not measured or now - max(measured) > PROBE_S


class _Tracked:
    __slots__ = (
        "life_load",
        "life_ticks",
        "load",
        "mark_bytes",
        "mark_t",
        "started",
        "stream",
        "ticks",
        "waited",
        "windows",
    )

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.started = False
        self.mark_t = 0.0
        self.mark_bytes = 0
        self.windows = 0
        self.load = 0
        """The engine's streams, summed over the ticks of the current window."""
        self.ticks = 0
        self.life_load = 0
        """The same over the stream's life from its first audio (its underrun's load)."""
        self.life_ticks = 0
        self.waited = False
        """Its text was seen open: its lead counts its client's pauses too."""


class Stream(Protocol):
    """What the controller reads of a stream (``gateway.streams.PcmStream``)."""

    engine: int
    opened_at: float
    first_audio_at: float | None
    first_chunk_bytes: int
    bytes_received: int
    min_lead_s: float
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
    node's number of streams on that engine; its end also says whether it underran, at its
    life's average load. A stream whose text is still open (ZeroMQ ``text_open``) waits on its
    client, not on the engines, and gives no generation or underrun samples.
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
        self.below_one: list[float | None] = [None] * engines
        """Per engine, the part of one stream it holds in real time while it cannot hold one
        (``CapacityModel.below_one``), else None: the capacity gauge shows it, and the log
        says so once when it starts and once when it ends."""

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
                if s.first_audio_at is not None:
                    t.life_load += loads[s.engine]
                    t.life_ticks += 1
            self._sample(t, now)
        for s in [s for s in tracked if s not in seen]:
            t = tracked.pop(s)
            if s.ended:
                self._sample(t, s.last_record_at, final=True)
                if t.started and t.life_ticks and not t.waited:
                    self.models[s.engine].observe_end(
                        round(t.life_load / t.life_ticks), s.min_lead_s < -UNDERRUN_S, now
                    )
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
            changes = model.changes
            limit = model.update(now)
            if model.changes != changes:
                log.info("capacity: engine %d holds %d streams (%s)", e, limit, model.reason)
            self._say_below_one(e, model.below_one(now), model)
            opinions.append(limit if model.fresh(now) else 0)
        return opinions

    def _say_below_one(self, e: int, held: float | None, model: CapacityModel) -> None:
        was = self.below_one[e]
        self.below_one[e] = held
        if held is not None and was is None:
            bad = model.lowest_bad()
            reason = f"one stream: {bad[2]}" if bad is not None else model.reason
            log.warning(
                "capacity: engine %d cannot hold one stream in real time (%s): it plays "
                "%.2f of one, so every stream it serves may play with gaps; admission still "
                "takes one stream at a time (give it faster or less shared cores, or a "
                "smaller model)",
                e,
                reason,
                held,
            )
        elif held is None and was is not None:
            log.info("capacity: engine %d holds one stream in real time again", e)

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
            t.waited = True
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
