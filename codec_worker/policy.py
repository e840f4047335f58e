"""Per-stream state and the window policy: which frames a stream's next window decodes.

A window is ``[start, end)`` frames with the emitted span ``[emit_start, emit_end)`` inside,
described by its ``WindowKey`` (context, hop, lookahead). The policy guarantees:

- every frame is emitted exactly once, in order, the first and the last included;
- the first window is small (``first_hop + first_lookahead`` frames) for early first audio;
- steady windows emit ``hop_frames * 2**k`` frames, up to ``max_hop_frames``, as the stream's
  backlog allows (the time axis of 2D batching), so their shapes come from a short list;
- after END the rest is emitted with whatever lookahead remains: the utterance's last frame
  is decoded against the same right edge as an offline decode;
- a stream about to miss its playback deadline may emit one frame with the first window's
  shorter lookahead (``late_key``) instead of waiting for the steady one.

A stream has at most one window in flight, so its chunks leave in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from codec_worker.decoder import WindowKey
from common.config.codec import CodecConfig
from shm.records import CODE_DTYPE, FRAME_CODES, SAMPLE_RATE, SAMPLES_PER_FRAME, StreamEnd

FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE


@dataclass(slots=True)
class StreamState:
    """A stream's codes and cursors inside the codec worker (frame indices are absolute)."""

    stream_id: int
    gateway: int
    seed: int
    created: float
    source: int = 0
    """The code ring (engine) the stream's codes come from."""
    frames: np.ndarray = field(default_factory=lambda: np.empty((64, FRAME_CODES), CODE_DTYPE))
    base: int = 0
    """Absolute index of ``frames[0]``; older frames were dropped once no window needs them."""
    received: int = 0
    scheduled: int = 0
    """Frames handed to a window (emitted or in flight)."""
    written: int = 0
    """Frames whose PCM was written."""
    chunks: int = 0
    """Next PCM sequence number."""
    end: StreamEnd | None = None
    in_flight: bool = False
    ready_since: float = math.nan
    """When the stream's current window became ready (NaN: none ready)."""
    play_start: float = math.nan
    """When its first chunk was written: the playback clock's origin."""
    mark_slot: int = 0
    """Its slot in the watermark's per-stream state (0: none, watermark off)."""

    def append(self, codes: np.ndarray, keep_from: int) -> None:
        """Append ``(n, 7)`` int16 frames, dropping stored frames before ``keep_from``."""
        n = codes.shape[0]
        stored = self.received - self.base
        drop = min(max(0, keep_from - self.base), stored)
        if stored + n > self.frames.shape[0]:
            keep = stored - drop
            cap = self.frames.shape[0]
            if keep + n > cap // 2:
                cap = max(cap * 2, 1 << (keep + n).bit_length())
            buf = np.empty((cap, FRAME_CODES), CODE_DTYPE) if cap != self.frames.shape[0] else None
            target = self.frames if buf is None else buf
            target[:keep] = self.frames[drop:stored]
            self.frames = target
            self.base += drop
            stored = keep
        self.frames[stored : stored + n] = codes
        self.received += n

    def window_codes(self, start: int, end: int) -> np.ndarray:
        """Frames ``[start, end)`` (a view valid until the next ``append``)."""
        return self.frames[start - self.base : end - self.base]

    def deadline(self, max_wait_s: float) -> float:
        """When the next frame must reach the gateway for playback without a gap.

        Before the first chunk there is no playback clock: the first window may wait for
        batching partners ``max_wait_s`` at most.
        """
        if math.isnan(self.play_start):
            return self.ready_since + max_wait_s
        return self.play_start + self.written * FRAME_S


@dataclass(slots=True)
class Window:
    state: StreamState
    key: WindowKey
    start: int
    """Absolute index of the window's first frame."""
    deadline: float
    late: bool = False
    """Taken with the shorter lookahead because the deadline was near (``late_key``)."""


class WindowPolicy:
    """Chooses each stream's next window from the codec configuration."""

    def __init__(self, cfg: CodecConfig) -> None:
        self.context = cfg.context_frames
        self.lookahead = cfg.lookahead_frames
        self.first_hop = cfg.first_hop_frames
        self.first_lookahead = cfg.first_lookahead_frames
        self.max_hop = max(cfg.max_hop_frames, cfg.hop_frames)
        hops = []
        h = cfg.hop_frames
        while h < self.max_hop:
            hops.append(h)
            h *= 2
        hops.append(self.max_hop)
        self.hops: tuple[int, ...] = tuple(hops)
        """Hops of steady windows, smallest first."""
        self.history = self.context
        """Frames before the emit cursor a window may read."""

    @property
    def first_window_frames(self) -> int:
        return self.first_hop + self.first_lookahead

    @property
    def max_hop_frames(self) -> int:
        return max(self.max_hop, self.first_hop)

    @property
    def max_window_frames(self) -> int:
        return self.context + self.max_hop_frames + max(self.lookahead, self.first_lookahead)

    def hot_keys(self) -> list[WindowKey]:
        """The first window's shape, the steady ones and the late one: what compilation warms."""
        late = [] if self.first_lookahead >= self.lookahead else [self.late_steady_key()]
        return [self.first_key(), *self.steady_keys(), *late]

    def steady_keys(self) -> list[WindowKey]:
        """Shapes of windows in the middle of a stream (the hot shapes, warmed at start)."""
        return [WindowKey(self.context, h, self.lookahead) for h in self.hops]

    def late_steady_key(self) -> WindowKey:
        """``late_key``'s shape once a stream has its full context."""
        return WindowKey(self.context, self.hops[0], self.first_lookahead)

    def first_key(self) -> WindowKey:
        return WindowKey(0, self.first_hop, self.first_lookahead)

    def next_key(self, s: StreamState) -> WindowKey | None:
        """The shape of ``s``'s next window, or None if it must wait for more frames."""
        done, avail = s.scheduled, s.received - s.scheduled
        if avail <= 0:
            return None
        ended = s.end is not None
        c = min(self.context, done)
        if done == 0:
            h = min(self.first_hop, avail)
            la = min(self.first_lookahead, avail - h)
            if not ended and (h < self.first_hop or la < self.first_lookahead):
                return None
            return WindowKey(0, h, la)
        if ended and avail <= self.max_hop:
            return WindowKey(c, avail, 0)  # the tail, against the utterance's right edge
        ready = min(avail if ended else avail - self.lookahead, self.max_hop)
        if ready < self.hops[0]:
            return None
        h = max(x for x in self.hops if x <= ready)
        return WindowKey(c, h, min(self.lookahead, avail - h))

    def late_key(self, s: StreamState) -> WindowKey | None:
        """A one-frame window with the first window's lookahead, for a live stream past its
        first window whose steady window still waits for lookahead frames; None otherwise.

        Right after the first chunk a stream has the least audio in hand, and its next steady
        window needs ``lookahead`` frames beyond it where the first needed
        ``first_lookahead``: the scheduler takes this window only when the deadline is near.
        """
        if s.end is not None or s.written == 0 or self.first_lookahead >= self.lookahead:
            return None
        hop = self.hops[0]
        avail = s.received - s.scheduled
        if not hop + self.first_lookahead <= avail < hop + self.lookahead:
            return None
        return WindowKey(min(self.context, s.scheduled), hop, self.first_lookahead)

    def can_grow(self, s: StreamState, key: WindowKey) -> bool:
        """Whether waiting for more frames would give ``s`` a longer window."""
        return s.end is None and s.scheduled > 0 and key.hop < self.max_hop
