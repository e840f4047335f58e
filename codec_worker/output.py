"""Where the codec worker's records go: the gateways' PCM rings, with per-ring backpressure.

Records are staged into a gateway's ring as they are produced and published once per batch
(``flush``). When a ring is full the records wait in that gateway's queue, in order, and the
other gateways' streams go on. A ring that accepts nothing for ``stall_timeout_s`` while
audio waits fails the streams whose audio is queued: ``flush`` drops their queued audio and
returns their ids, and the service queues an ERROR for each.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from shm.records import RecordKind
from shm.ring import RingWriter

Payload = bytes | bytearray | memoryview | np.ndarray


class RecordSink(Protocol):
    def put(self, gateway: int, kind: int, stream_id: int, seq: int, payload: Payload) -> None:
        """Queue one record for ``gateway`` (the payload is copied before this returns)."""

    def flush(self, now: float) -> list[int]:
        """Publish what was queued; returns the streams failed by a ring stalled too long."""

    def occupancy(self) -> list[float]:
        """Fraction of each gateway's ring in use (1.0 while records wait for space)."""


class _Queued(NamedTuple):
    kind: int
    stream_id: int
    seq: int
    payload: bytes


class RingSink:
    """Writes to one ring per gateway (``RingWriter`` on ``layout.pcm_ring(i)``)."""

    def __init__(
        self,
        writers: Sequence[RingWriter],
        stall_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._writers = list(writers)
        self._queues: list[deque[_Queued]] = [deque() for _ in self._writers]
        self._staged = [False] * len(self._writers)
        self._blocked_since: list[float | None] = [None] * len(self._writers)
        self._stall_s = stall_timeout_s
        self._clock = clock

    def put(self, gateway: int, kind: int, stream_id: int, seq: int, payload: Payload) -> None:
        queue = self._queues[gateway]
        if not queue and self._writers[gateway].try_append(kind, stream_id, seq, payload):
            self._staged[gateway] = True
            return
        if self._blocked_since[gateway] is None:
            self._blocked_since[gateway] = self._clock()
        queue.append(_Queued(kind, stream_id, seq, bytes(memoryview(payload).cast("B"))))

    def flush(self, now: float) -> list[int]:
        failed: list[int] = []
        for g, writer in enumerate(self._writers):
            queue = self._queues[g]
            progressed = False
            while queue and writer.try_append(*queue[0]):
                queue.popleft()
                progressed = True
            if progressed or self._staged[g]:
                writer.publish()
                self._staged[g] = False
            if not queue:
                self._blocked_since[g] = None
                continue
            since = self._blocked_since[g]
            if progressed or since is None:
                self._blocked_since[g] = now
            elif now - since > self._stall_s:
                failed.extend(self._drop_audio(g))
                self._blocked_since[g] = now
        return failed

    def _drop_audio(self, g: int) -> list[int]:
        """Drop the queued records of every stream with audio queued for gateway ``g``.

        Streams that only have END/ERROR queued are finished: their records stay."""
        queue = self._queues[g]
        stuck = {q.stream_id for q in queue if q.kind == RecordKind.PCM}
        self._queues[g] = deque(q for q in queue if q.stream_id not in stuck)
        return sorted(stuck)

    def occupancy(self) -> list[float]:
        return [
            1.0 if q else 1.0 - w.free_bytes() / w.capacity
            for w, q in zip(self._writers, self._queues, strict=True)
        ]

    def queued(self, gateway: int) -> int:
        return len(self._queues[gateway])


class CollectingSink:
    """Keeps records in memory, in order (offline decoding, the benchmark, tests)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, int, int, int, bytes]] = []

    def put(self, gateway: int, kind: int, stream_id: int, seq: int, payload: Payload) -> None:
        self.records.append((gateway, kind, stream_id, seq, bytes(memoryview(payload).cast("B"))))

    def flush(self, now: float) -> list[int]:
        return []

    def occupancy(self) -> list[float]:
        return []
