"""Would a real player have played this stream without a gap?

A player starts at the first byte plus a jitter buffer and then consumes samples at the
sample rate. A piece of audio whose first sample arrives after the player needs it is
late by ``lag = t_arrival - (t_first_byte + jitter + first_sample / rate)``. That
fixed playback clock gives a clean identity: a player that pauses and resumes on each
gap (rebuffering) has stalled, after piece ``i``, for ``max(0, max_{j<=i} lag_j)``
seconds in total. So

- ``worst_lag_s`` (the largest lag against the fixed clock) is also the total stall
  time of a rebuffering player;
- ``underruns`` is how many times that player stalls: the number of pieces whose lag
  exceeds every earlier lag and zero (each is a new gap a listener hears);
- ``first_gap_s`` is where in the audio the first of them falls (whether streams break at
  their start or in their middle points at different causes).

A stream is playable when it has no underrun.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from shm.records import BYTES_PER_SAMPLE, SAMPLE_RATE


class Playback(msgspec.Struct, frozen=True, kw_only=True):
    underruns: int
    worst_lag_s: float
    """Largest lateness against the fixed playback clock; <= 0 means never late."""
    first_gap_s: float | None = None
    """Audio position (seconds into the stream) of the first underrun; None without one."""


def analyze_playback(
    times: Sequence[float],
    sizes: Sequence[int],
    *,
    jitter_buffer_s: float,
    sample_rate: int = SAMPLE_RATE,
    bytes_per_sample: int = BYTES_PER_SAMPLE,
) -> Playback:
    """Underruns and worst lag of one stream from its arrival trace.

    ``times[i]`` is when ``sizes[i]`` bytes arrived (any split: network reads need not
    align with chunks or even with samples). Times are in seconds on one clock.
    """
    if len(times) != len(sizes):
        raise ValueError("times and sizes differ in length")
    if not times:
        return Playback(underruns=0, worst_lag_s=0.0)
    start = times[0] + jitter_buffer_s
    received = 0
    worst = float("-inf")
    underruns = 0
    first_gap: float | None = None
    for t, n in zip(times, sizes, strict=True):
        if n <= 0:
            continue
        position = received // bytes_per_sample / sample_rate
        lag = t - (start + position)
        if lag > 0.0 and lag > worst:
            underruns += 1
            if first_gap is None:
                first_gap = position
        worst = max(worst, lag)
        received += n
    return Playback(underruns=underruns, worst_lag_s=worst, first_gap_s=first_gap)
