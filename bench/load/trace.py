"""What the load generator records about one request, and what follows from it.

All times are ``time.perf_counter()`` seconds. ``scheduled`` is when the request was
*meant* to be sent (open loop: its slot in the precomputed schedule; closed loop: the
moment its client became free). Latencies are measured from it, never from ``sent``,
so a generator that falls behind cannot hide the wait it caused (coordinated omission).
"""

from __future__ import annotations

import enum

import msgspec

from bench.load.playback import analyze_playback
from shm.records import BYTES_PER_SAMPLE, FRAME_CODES, SAMPLE_RATE, SAMPLES_PER_FRAME


class Outcome(enum.StrEnum):
    OK = "ok"
    HTTP_ERROR = "http_error"  # a non-200 answer (429/503 over capacity, 4xx/5xx)
    BROKEN = "broken"  # the connection failed or the stream ended abnormally
    NO_AUDIO = "no_audio"  # 200 but not one sample
    TIMEOUT = "timeout"  # still running at the run's hard deadline
    CANCELLED = "cancelled"  # a filler request stopped by the generator on purpose


class StreamTrace(msgspec.Struct, kw_only=True):
    index: int
    kind: str
    """Corpus kind of the text: "short" or "long"."""
    chars: int
    scheduled: float
    measured: bool = False
    """In the stable window (not warm-up, not a filler that only holds the load)."""
    sent: float | None = None
    status: int | None = None
    outcome: Outcome | None = None
    error: str = ""
    retry_after_s: float | None = None
    """A refusal's ``Retry-After`` (None: none was sent)."""
    done: float | None = None
    times: list[float] = []
    sizes: list[int] = []

    def record(self, t: float, nbytes: int) -> None:
        self.times.append(t)
        self.sizes.append(nbytes)

    @property
    def audio_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def first_byte(self) -> float | None:
        return self.times[0] if self.times else None

    @property
    def last_byte(self) -> float | None:
        return self.times[-1] if self.times else None


class StreamMetrics(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    kind: str
    outcome: Outcome
    ttfb_s: float | None
    """First byte minus *scheduled* send time."""
    rtf: float | None
    """(last byte - scheduled) / audio seconds."""
    audio_s: float
    underruns: int
    worst_lag_s: float
    first_gap_s: float | None = None
    """Audio position of the first underrun (bench.load.playback)."""
    send_lag_s: float | None
    """Actual send minus scheduled send: how far the generator itself fell behind."""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def audio_seconds(nbytes: int) -> float:
    return nbytes // BYTES_PER_SAMPLE / SAMPLE_RATE


def tokens_of_audio(nbytes: int) -> float:
    """LLM tokens that made this much audio: 7 tokens per 2048-sample frame."""
    return nbytes // BYTES_PER_SAMPLE / SAMPLES_PER_FRAME * FRAME_CODES


def stream_metrics(trace: StreamTrace, *, jitter_buffer_s: float) -> StreamMetrics:
    outcome = trace.outcome if trace.outcome is not None else Outcome.BROKEN
    audio = audio_seconds(trace.audio_bytes)
    if outcome is Outcome.OK and audio == 0.0:
        outcome = Outcome.NO_AUDIO
    first, last = trace.first_byte, trace.last_byte
    ttfb = first - trace.scheduled if first is not None else None
    rtf = (last - trace.scheduled) / audio if last is not None and audio > 0 else None
    playback = analyze_playback(trace.times, trace.sizes, jitter_buffer_s=jitter_buffer_s)
    return StreamMetrics(
        index=trace.index,
        kind=trace.kind,
        outcome=outcome,
        ttfb_s=ttfb,
        rtf=rtf,
        audio_s=audio,
        underruns=playback.underruns,
        worst_lag_s=playback.worst_lag_s,
        first_gap_s=playback.first_gap_s,
        send_lag_s=trace.sent - trace.scheduled if trace.sent is not None else None,
    )
