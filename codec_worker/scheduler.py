"""When to dispatch a codec batch, and which windows go in it (2D dynamic batching).

Each stream offers at most one window: its next one, as long as its backlog allows (the
time axis). A batch takes ready windows across streams (the streams axis) in order of
playback deadline, at most ``max_batch``. It is dispatched as soon as

- ``max_batch`` windows are ready, or
- no other stream could add a window by waiting (every live stream has one ready), or
- the oldest ready window has waited ``max_wait_ms``, or
- the earliest deadline is closer than the recent decode time of a batch.

A stream whose steady window waits for lookahead frames while its next frame is nearly due
(within the recent decode time plus ``late_lookahead_ms``) takes the policy's shorter
``late_key`` window instead: a seam decoded with less right context rather than a gap.

A stream far enough ahead of its playback (``hold_ahead_ms``) whose window could still grow
is held back until it can fill a ``max_hop_frames`` window: under load the codec spends its
time on fewer, longer windows, with less redundant context, instead of many one-frame ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from codec_worker.policy import StreamState, Window, WindowPolicy
from common.config.codec import CodecConfig

_EWMA = 0.2


class Scheduler:
    def __init__(self, cfg: CodecConfig, policy: WindowPolicy) -> None:
        self.policy = policy
        self.max_batch = cfg.max_batch
        self.max_wait_s = cfg.max_wait_ms / 1000
        self.hold_s = cfg.hold_ahead_ms / 1000 if cfg.hold_ahead_ms >= 0 else math.inf
        self.late_s = cfg.late_lookahead_ms / 1000 if cfg.late_lookahead_ms >= 0 else None
        self.decode_estimate_s = 0.0
        self.wakeup_at = math.inf
        """When ``select`` may next return a batch if no frames arrive before."""

    def observe_decode(self, seconds: float) -> None:
        self.decode_estimate_s += _EWMA * (seconds - self.decode_estimate_s)

    def select(self, streams: Iterable[StreamState], now: float) -> list[Window]:
        """The windows of the batch to dispatch now, deadline first; empty if none is due."""
        policy = self.policy
        ready: list[Window] = []
        waiting = 0
        held_until = oldest = earliest = late_at = math.inf
        for s in streams:
            if s.in_flight:
                continue
            key = policy.next_key(s)
            late = False
            if key is None and self.late_s is not None and (key := policy.late_key(s)):
                # A late key needs a written chunk: the deadline is the playback clock's.
                due = s.deadline(self.max_wait_s) - self.decode_estimate_s - self.late_s
                late = now >= due
                if not late:
                    late_at = min(late_at, due)
                    key = None
            if key is None:
                s.ready_since = math.nan
                waiting += s.end is None
                continue
            if math.isnan(s.ready_since):
                s.ready_since = now
            deadline = s.deadline(self.max_wait_s)
            if deadline - now > self.hold_s and policy.can_grow(s, key):
                held_until = min(held_until, deadline - self.hold_s)
                continue
            oldest = min(oldest, s.ready_since)
            earliest = min(earliest, deadline)
            ready.append(Window(s, key, s.scheduled - key.context, deadline, late))
        due_at = min(oldest + self.max_wait_s, earliest - self.decode_estimate_s)
        if ready and (len(ready) >= self.max_batch or waiting == 0 or now >= due_at):
            ready.sort(key=_by_deadline)
            self.wakeup_at = now
            return ready[: self.max_batch]
        self.wakeup_at = min(held_until, due_at, late_at)
        return []


def _by_deadline(w: Window) -> float:
    return w.deadline
