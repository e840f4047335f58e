"""Frames -> SNAC levels (docs/orpheus.md slot layout), code validation, positional noise."""

from __future__ import annotations

import numpy as np
import torch

from codec_worker.levels import frames_to_levels, invalid_code_count, levels_to_frames
from codec_worker.noise import block_seeds, positional_noise, stream_seed


def test_slot_layout_matches_orpheus() -> None:
    # Frame f holds codes 100*f + slot, so every level's order can be read off the values.
    frames = torch.tensor([[[100 * f + s for s in range(7)] for f in range(3)]])
    l0, l1, l2 = frames_to_levels(frames)
    assert l0.tolist() == [[0, 100, 200]]
    assert l1.tolist() == [[1, 4, 101, 104, 201, 204]]
    assert l2.tolist() == [[2, 3, 5, 6, 102, 103, 105, 106, 202, 203, 205, 206]]
    assert l0.dtype == torch.int64


def test_levels_round_trip_over_a_batch() -> None:
    frames = torch.randint(0, 4096, (5, 9, 7))
    assert torch.equal(levels_to_frames(*frames_to_levels(frames)), frames)


def test_invalid_codes_are_counted_including_negative_and_code_zero_is_valid() -> None:
    codes = np.zeros((4, 7), np.int16)
    assert invalid_code_count(codes) == 0
    codes[0, 0], codes[1, 3], codes[2, 6] = 4095, 4096, -1
    assert invalid_code_count(codes) == 2


def test_noise_is_a_function_of_seed_and_absolute_position() -> None:
    seeds = block_seeds(torch.tensor([stream_seed(0, 7), stream_seed(0, 8)]), 2)
    pos = torch.arange(1000, 3000)[None].expand(2, -1)
    whole = positional_noise(seeds, pos)
    # Any overlapping window draws the same values where it overlaps.
    part = positional_noise(seeds, pos[:, 500:700].contiguous())
    assert torch.equal(part, whole[:, 500:700])
    # Different streams and different blocks draw different noise.
    assert not torch.allclose(whole[0], whole[1])
    other_block = positional_noise(block_seeds(seeds, 3), pos)
    assert torch.corrcoef(torch.stack([whole[0], other_block[0]]))[0, 1].abs() < 0.1


def test_noise_is_standard_normal() -> None:
    seeds = block_seeds(torch.tensor([stream_seed(3, 1)]), 0)
    x = positional_noise(seeds, torch.arange(200_000)[None]).double()
    assert abs(x.mean().item()) < 0.01
    assert abs(x.std().item() - 1.0) < 0.01
    # Fourth moment of a standard normal is 3; lag-1 correlation is ~0 (white noise).
    assert abs((x**4).mean().item() - 3.0) < 0.1
    assert torch.corrcoef(torch.stack([x[0, :-1], x[0, 1:]]))[0, 1].abs() < 0.01
    assert torch.isfinite(x).all()
