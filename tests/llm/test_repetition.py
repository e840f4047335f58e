"""The repetition guard ends runaway loops: the last N frames cycling with a short period."""

from __future__ import annotations

import numpy as np
import pytest

from llm_worker.repetition import RepetitionGuard

N = 24


def _feed(guard: RepetitionGuard, row: int, frames: np.ndarray) -> list[bool]:
    """One frame per step; returns the guard's verdict after each."""
    return [
        bool(guard.observe(np.array([row]), frames[i : i + 1], np.array([1]))[0])
        for i in range(len(frames))
    ]


def _random_frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7)).astype(np.int16)


@pytest.mark.parametrize("period", [1, 2, 3, N // 4])
def test_loop_detected_exactly_when_the_window_cycles(period: int) -> None:
    guard = RepetitionGuard(N)
    row = 3
    cycle = _random_frames(period, seed=period)
    frames = np.concatenate([_random_frames(10, seed=99), np.tile(cycle, (N // period + 2, 1))])
    verdicts = _feed(guard, row, frames)
    first = verdicts.index(True)
    # The loop starts at frame 10; the last N frames are periodic once N of them are in.
    assert first == 10 + N - 1


def test_random_frames_and_long_periods_pass() -> None:
    guard = RepetitionGuard(N)
    assert not any(_feed(guard, 0, _random_frames(300, seed=1)))
    long_cycle = _random_frames(N // 4 + 1, seed=2)
    assert not any(_feed(guard, 1, np.tile(long_cycle, (20, 1))))


def test_rows_are_independent_and_reset_clears() -> None:
    guard = RepetitionGuard(N, capacity=2)
    guard.ensure_capacity(4)
    loop = np.tile(_random_frames(1, seed=3), (N, 1))
    rng_frames = _random_frames(N, seed=4)
    verdicts = [
        guard.observe(np.array([0, 3]), np.stack([loop[i], rng_frames[i]]), np.array([1, 1]))
        for i in range(N)
    ]
    assert verdicts[-1].tolist() == [True, False] and not verdicts[-2].any()
    guard.reset(0)
    assert not any(_feed(guard, 0, loop[: N - 1]))


def test_several_frames_per_step_equal_one_at_a_time() -> None:
    frames = np.concatenate(
        [_random_frames(5, seed=5), np.tile(_random_frames(2, seed=6), (15, 1))]
    )
    one = _feed(RepetitionGuard(N), 0, frames)
    batched = RepetitionGuard(N)
    hits = []
    for a in range(0, len(frames), 4):
        chunk = frames[a : a + 4]
        hits.append(bool(batched.observe(np.array([0]), chunk, np.array([len(chunk)]))[0]))
    assert hits == [any(one[a : a + 4]) for a in range(0, len(frames), 4)]


def test_disabled() -> None:
    guard = RepetitionGuard(0)
    assert not guard.enabled
    assert not any(_feed(guard, 0, np.zeros((100, 7), np.int16)))
