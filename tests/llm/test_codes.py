"""Audio tokens to SNAC frames (docs/orpheus.md): code 0 valid, invalid tokens drop only their
frame, positions never shift, frames span engine steps, many streams per call."""

from __future__ import annotations

from itertools import chain

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_worker.codes import FrameAssembler, StepFrames, frames_to_tokens
from llm_worker.vllm_ext import tokens as T
from shm.records import CODEBOOK_SIZE


def _map_one(asm: FrameAssembler, row: int, tokens: list[int]) -> StepFrames:
    return asm.map(np.array([row]), np.array([len(tokens)]), np.array(tokens, dtype=np.int64))


def _reference(tokens: list[int]) -> tuple[list[list[int]], int, int]:
    """Per-token reference: (valid frames, dropped frames, invalid tokens)."""
    frames, dropped, invalid = [], 0, 0
    for f in range(len(tokens) // 7):
        codes = [tokens[7 * f + s] - T.AUDIO_TOKEN_BASE - s * CODEBOOK_SIZE for s in range(7)]
        bad = sum(not 0 <= c < CODEBOOK_SIZE for c in codes)
        invalid += bad
        if bad:
            dropped += 1
        else:
            frames.append(codes)
    invalid += sum(
        not 0 <= tokens[i] - T.AUDIO_TOKEN_BASE - (i % 7) * CODEBOOK_SIZE < CODEBOOK_SIZE
        for i in range(len(tokens) // 7 * 7, len(tokens))
    )
    return frames, dropped, invalid


def test_code_zero_is_valid() -> None:
    asm = FrameAssembler()
    row = asm.open()
    step = _map_one(asm, row, frames_to_tokens(np.zeros((2, 7), np.int16)).tolist())
    assert step.counts.tolist() == [2] and step.dropped.tolist() == [0]
    assert np.array_equal(step.frames, np.zeros((2, 7)))


def test_slot_offsets_and_extremes() -> None:
    asm = FrameAssembler()
    row = asm.open()
    frame = [0, 4095, 1, 4094, 2048, 7, 4095]
    tokens = [T.AUDIO_TOKEN_BASE + s * 4096 + c for s, c in enumerate(frame)]
    assert tokens[0] == 128266 and tokens[1] == 128266 + 4096 + 4095
    step = _map_one(asm, row, tokens)
    assert step.frames.tolist() == [frame] and step.frames.dtype == np.dtype("<i2")


def test_invalid_token_drops_only_its_frame_and_never_shifts() -> None:
    asm = FrameAssembler()
    row = asm.open()
    frames = np.arange(3 * 7, dtype=np.int16).reshape(3, 7) * 10
    tokens = frames_to_tokens(frames).tolist()
    tokens[9] = T.AUDIO_TOKEN_BASE  # slot 2 of frame 1 given a slot-0 token: invalid
    step = _map_one(asm, row, tokens)
    assert step.counts.tolist() == [2] and step.dropped.tolist() == [1]
    assert step.invalid_tokens.tolist() == [1]
    assert np.array_equal(step.frames, frames[[0, 2]]), "frame 2 keeps its positions"


def test_text_and_stop_tokens_are_invalid() -> None:
    asm = FrameAssembler()
    row = asm.open()
    tokens = frames_to_tokens(np.ones((2, 7), np.int16)).tolist()
    tokens[0] = 100  # a text token
    tokens[13] = T.END_OF_SPEECH
    step = _map_one(asm, row, tokens)
    assert step.counts.tolist() == [0] and step.dropped.tolist() == [2]


def test_frames_span_steps() -> None:
    asm = FrameAssembler()
    row = asm.open()
    frames = np.array([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]], np.int16)
    tokens = frames_to_tokens(frames).tolist()
    counts, got = [], []
    for a, b in [(0, 3), (3, 4), (4, 10), (10, 14)]:
        step = _map_one(asm, row, tokens[a:b])
        counts.append(int(step.counts[0]))
        got.append(step.frames.copy())  # a view into scratch: valid until the next map
    assert counts == [0, 0, 1, 1]
    assert np.array_equal(np.concatenate(got), frames)
    assert asm.position(row) == 14 and asm.pending_tokens(row) == 0


def test_invalid_token_in_an_earlier_step_drops_the_frame_later() -> None:
    asm = FrameAssembler()
    row = asm.open()
    tokens = frames_to_tokens(np.full((1, 7), 5, np.int16)).tolist()
    tokens[1] = 0
    first = _map_one(asm, row, tokens[:4])
    second = _map_one(asm, row, tokens[4:])
    assert first.invalid_tokens.tolist() == [1] and first.dropped.tolist() == [0]
    assert second.counts.tolist() == [0] and second.dropped.tolist() == [1]


def test_reset_starts_a_new_generation_at_position_zero() -> None:
    asm = FrameAssembler()
    row = asm.open()
    _map_one(asm, row, frames_to_tokens(np.ones((1, 7), np.int16)).tolist()[:5])
    assert asm.pending_tokens(row) == 5
    asm.reset(row)
    step = _map_one(asm, row, frames_to_tokens(np.full((1, 7), 3, np.int16)).tolist())
    assert step.frames.tolist() == [[3] * 7]


def test_many_streams_one_call_and_row_growth() -> None:
    asm = FrameAssembler(capacity=2)
    rows = [asm.open() for _ in range(5)]
    assert asm.capacity >= 5 and len(set(rows)) == 5
    per = [frames_to_tokens(np.full((k, 7), k, np.int16)).tolist() for k in range(5)]
    step = asm.map(
        np.array(rows), np.array([len(p) for p in per]), np.array(list(chain(*per)), dtype=np.int64)
    )
    assert step.counts.tolist() == [0, 1, 2, 3, 4]
    off = step.offsets()
    for k in range(5):
        assert (step.frames[off[k] : off[k + 1]] == k).all()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.floats(0.0, 0.15), st.integers(1, 6)),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2**32 - 1),
)
def test_vectorised_equals_reference(spec: list[tuple[int, float, int]], seed: int) -> None:
    """Random streams, random invalid tokens, random step chunking: same as per-token code."""
    rng = np.random.default_rng(seed)
    asm = FrameAssembler(capacity=1)
    streams = []
    for n_tokens, p_bad, max_chunk in spec:
        codes = rng.integers(0, 4096, size=n_tokens)
        toks = [T.AUDIO_TOKEN_BASE + (i % 7) * 4096 + int(c) for i, c in enumerate(codes)]
        for i in np.flatnonzero(rng.random(n_tokens) < p_bad):
            toks[i] = int(rng.integers(0, 156940))
        streams.append({"row": asm.open(), "toks": toks, "at": 0, "max": max_chunk,
                        "frames": [], "dropped": 0, "invalid": 0})  # fmt: skip
    while any(s["at"] < len(s["toks"]) for s in streams):
        active = [s for s in streams if s["at"] < len(s["toks"]) and rng.random() < 0.8]
        if not active:
            continue
        chunks = []
        for s in active:
            n = int(rng.integers(1, s["max"] + 1))
            chunks.append(s["toks"][s["at"] : s["at"] + n])
            s["at"] += len(chunks[-1])
        step = asm.map(
            np.array([s["row"] for s in active]),
            np.array([len(c) for c in chunks]),
            np.array(list(chain(*chunks)), dtype=np.int64),
        )
        off = step.offsets()
        for i, s in enumerate(active):
            s["frames"].extend(step.frames[off[i] : off[i + 1]].tolist())
            s["dropped"] += int(step.dropped[i])
            s["invalid"] += int(step.invalid_tokens[i])
    for s in streams:
        frames, dropped, invalid = _reference(s["toks"])
        assert s["frames"] == frames
        assert (s["dropped"], s["invalid"]) == (dropped, invalid)
        assert asm.pending_tokens(s["row"]) == len(s["toks"]) % 7


def test_one_token_per_step_fast_path_equals_reference() -> None:
    rng = np.random.default_rng(7)
    asm = FrameAssembler(capacity=2)
    n_streams, n_steps = 5, 60
    toks = [
        [T.AUDIO_TOKEN_BASE + (i % 7) * 4096 + int(rng.integers(0, 4096)) for i in range(n_steps)]
        for _ in range(n_streams)
    ]
    toks[1][9] = 5  # invalid: drops frame 1 of stream 1
    toks[3][20] = T.AUDIO_TOKEN_BASE  # wrong slot: drops frame 2 of stream 3
    rows = np.array([asm.open() for _ in range(n_streams)])
    got: list[list[list[int]]] = [[] for _ in range(n_streams)]
    for step in range(n_steps):
        out = asm.map(rows, np.ones(n_streams, np.int64), np.array([t[step] for t in toks]))
        off = out.offsets()
        for i in range(n_streams):
            got[i].extend(out.frames[off[i] : off[i + 1]].tolist())
    for i in range(n_streams):
        assert got[i] == _reference(toks[i])[0]
    assert len(got[1]) == len(got[0]) - 1 and len(got[3]) == len(got[0]) - 1
