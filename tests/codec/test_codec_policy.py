"""Window policy: every frame once, in order, first and last included; bounded shapes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from codec_worker.policy import StreamState, WindowPolicy
from common.config.codec import CodecConfig
from shm.records import StreamEnd

CONFIGS = st.builds(
    CodecConfig,
    context_frames=st.integers(0, 3),
    hop_frames=st.integers(1, 2),
    lookahead_frames=st.integers(0, 3),
    first_hop_frames=st.integers(1, 3),
    first_lookahead_frames=st.integers(0, 2),
    max_hop_frames=st.integers(2, 12),
)


@settings(max_examples=300, deadline=None)
@given(
    cfg=CONFIGS,
    arrivals=st.lists(st.integers(0, 9), min_size=1, max_size=30),
    decode_every=st.lists(st.booleans(), min_size=1, max_size=30),
    late=st.lists(st.booleans(), min_size=1, max_size=30),
)
def test_windows_cover_every_frame_once_in_order(
    cfg: CodecConfig, arrivals: list[int], decode_every: list[bool], late: list[bool]
) -> None:
    """Also when the scheduler takes the short-lookahead late window whenever offered."""
    policy = WindowPolicy(cfg)
    s = StreamState(stream_id=1, gateway=0, seed=0, created=0.0)
    codes = np.arange(sum(arrivals) * 7, dtype=np.int16).reshape(-1, 7) % 4096
    emitted: list[int] = []
    hot = set(policy.hot_keys())

    def decode_one() -> bool:
        key = policy.next_key(s)
        if key is None and late[len(emitted) % len(late)]:
            key = policy.late_key(s)
            assert key is None or (key.hop, key.lookahead) == (
                cfg.hop_frames,
                policy.first_lookahead,
            )
        if key is None:
            return False
        start = s.scheduled - key.context
        assert start >= 0 and start + key.frames <= s.received
        assert key.frames <= policy.max_window_frames and key.hop <= policy.max_hop_frames
        # The codes the window reads are the stream's frames at those positions.
        window = s.window_codes(start, start + key.frames)
        assert np.array_equal(window, codes[start : start + key.frames])
        if s.scheduled == 0 and s.end is None:
            assert key == policy.first_key()
        elif s.end is None and key.context == policy.context:
            assert key in hot  # mid-stream shapes come from the short, warmed list
        emitted.extend(range(s.scheduled, s.scheduled + key.hop))
        s.scheduled += key.hop
        s.written = s.scheduled
        return True

    pos = 0
    for i, n in enumerate(arrivals):
        s.append(codes[pos : pos + n], keep_from=s.scheduled - policy.history)
        pos += n
        if decode_every[i % len(decode_every)]:
            while decode_one():
                pass
    s.end = StreamEnd("stop", pos)
    while decode_one():
        pass
    assert emitted == list(range(pos))


def test_first_window_is_small_and_steady_hops_come_from_the_buckets() -> None:
    policy = WindowPolicy(CodecConfig(max_hop_frames=8))
    assert policy.first_window_frames == 2
    assert policy.hops == (1, 2, 4, 8)
    s = StreamState(stream_id=1, gateway=0, seed=0, created=0.0)
    s.append(np.zeros((1, 7), np.int16), 0)
    assert policy.next_key(s) is None  # the first window waits for its lookahead frame
    s.append(np.zeros((1, 7), np.int16), 0)
    assert tuple(policy.next_key(s) or ()) == (0, 1, 1)
    s.scheduled = 1
    s.append(np.zeros((6, 7), np.int16), 0)  # 8 frames received, 7 not emitted
    # 7 frames ready minus 2 of lookahead: a hop of 4 (a bucket), not 5.
    assert tuple(policy.next_key(s) or ()) == (1, 4, 2)
    assert policy.can_grow(s, policy.next_key(s))  # type: ignore[arg-type]
    s.end = StreamEnd("stop", 8)
    # After END the rest goes in one window that ends at the utterance's edge.
    assert tuple(policy.next_key(s) or ()) == (1, 7, 0)


def test_stream_buffer_keeps_only_the_frames_windows_still_need() -> None:
    s = StreamState(stream_id=1, gateway=0, seed=0, created=0.0)
    for i in range(200):
        s.scheduled = max(0, s.received - 3)
        s.append(np.full((5, 7), i, np.int16), keep_from=s.scheduled - 1)
    assert s.received == 1000
    assert s.frames.shape[0] <= 64  # compacted in place, never grown without need
    assert np.array_equal(s.window_codes(996, 1000), np.full((4, 7), 199, np.int16))


def test_late_key_offers_one_frame_with_the_first_lookahead_only_when_the_steady_one_waits() -> (
    None
):
    policy = WindowPolicy(CodecConfig(lookahead_frames=2, first_lookahead_frames=1))
    s = StreamState(stream_id=1, gateway=0, seed=0, created=0.0)
    s.append(np.zeros((2, 7), np.int16), 0)
    assert policy.late_key(s) is None  # no chunk written yet: the first window is the first key
    s.scheduled = s.written = 1
    assert policy.next_key(s) is None  # the steady window needs frames 2 and 3 as lookahead
    assert policy.late_key(s) is None  # one frame beyond the emit cursor is not even enough
    s.append(np.zeros((1, 7), np.int16), 0)
    assert policy.next_key(s) is None
    assert tuple(policy.late_key(s) or ()) == (1, 1, 1)
    s.append(np.zeros((1, 7), np.int16), 0)
    assert tuple(policy.next_key(s) or ()) == (1, 1, 2)
    assert policy.late_key(s) is None  # the steady window is ready: nothing to cut
    s.scheduled = s.written = 3
    s.append(np.zeros((1, 7), np.int16), 0)
    assert policy.late_key(s) == policy.late_steady_key()
    assert policy.late_steady_key() in policy.hot_keys()  # compiled like the steady shapes
    s.end = StreamEnd("stop", 5)
    assert policy.late_key(s) is None  # after END the tail window ends at the utterance's edge
    same = WindowPolicy(CodecConfig(lookahead_frames=1, first_lookahead_frames=1))
    assert same.late_key(s) is None and len(same.hot_keys()) == 1 + len(same.steady_keys())
