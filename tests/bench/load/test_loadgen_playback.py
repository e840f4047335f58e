"""Underruns and worst lag on synthetic arrival traces (24 kHz int16: 4800 bytes = 0.1 s)."""

from __future__ import annotations

import pytest

from bench.load.playback import analyze_playback

TENTH = 4_800  # bytes of 0.1 s of audio


def test_steady_stream_never_underruns() -> None:
    times = [0.1 * i for i in range(10)]
    p = analyze_playback(times, [TENTH] * 10, jitter_buffer_s=0.1)
    assert p.underruns == 0
    assert p.worst_lag_s == pytest.approx(-0.1)  # always one jitter buffer early


def test_slow_stream_underruns_on_every_new_gap() -> None:
    # 0.1 s of audio every 0.15 s: lag_i = 0.15 i - (0.1 + 0.1 i) = 0.05 i - 0.1,
    # positive and growing from i = 3: three separate stalls, the player is 0.15 s late.
    times = [0.15 * i for i in range(6)]
    p = analyze_playback(times, [TENTH] * 6, jitter_buffer_s=0.1)
    assert p.underruns == 3
    assert p.worst_lag_s == pytest.approx(0.15)


def test_one_gap_then_catch_up_is_one_underrun() -> None:
    # Pieces 3..5 all arrive at 0.5 s; piece 3 was needed at 0.1 + 0.3 = 0.4 s.
    times = [0.0, 0.1, 0.2, 0.5, 0.5, 0.5]
    p = analyze_playback(times, [TENTH] * 6, jitter_buffer_s=0.1)
    assert p.underruns == 1
    assert p.worst_lag_s == pytest.approx(0.1)
    assert p.first_gap_s == pytest.approx(0.3)  # the gap falls 0.3 s into the audio


def test_first_gap_is_the_first_stall_not_the_worst() -> None:
    times = [0.0, 0.1, 0.4, 0.4, 0.65]  # stalls at pieces 2 (0.1 s) and 4 (0.15 s)
    p = analyze_playback(times, [TENTH] * 5, jitter_buffer_s=0.1)
    assert p.first_gap_s == pytest.approx(0.2)
    steady = analyze_playback([0.1 * i for i in range(5)], [TENTH] * 5, jitter_buffer_s=0.1)
    assert steady.first_gap_s is None


def test_jitter_buffer_absorbs_the_same_gap() -> None:
    times = [0.0, 0.1, 0.2, 0.5, 0.5, 0.5]
    p = analyze_playback(times, [TENTH] * 6, jitter_buffer_s=0.25)
    assert p.underruns == 0
    assert p.worst_lag_s == pytest.approx(-0.05)


def test_reads_split_inside_a_sample() -> None:
    # Network reads need not align with samples: 3 bytes, then the rest of 0.1 s.
    # The second read starts at sample 1, needed at 0.1 + 1/24000 s; it came at 0.2 s.
    p = analyze_playback([0.0, 0.2], [3, TENTH - 3], jitter_buffer_s=0.1)
    assert p.underruns == 1
    assert p.worst_lag_s == pytest.approx(0.1 - 1 / 24_000)


def test_late_after_a_stall_counts_only_the_extra_stall() -> None:
    # Stall of 0.1 s at piece 2, then piece 4 is 0.15 s late: a second, new stall.
    times = [0.0, 0.1, 0.4, 0.4, 0.65]
    p = analyze_playback(times, [TENTH] * 5, jitter_buffer_s=0.1)
    # lags: -0.1, -0.1, 0.1, 0.0, 0.15
    assert p.underruns == 2
    assert p.worst_lag_s == pytest.approx(0.15)


def test_empty_trace() -> None:
    p = analyze_playback([], [], jitter_buffer_s=0.1)
    assert p.underruns == 0 and p.worst_lag_s == 0.0
