"""Where the llm service's records go: the code ring, with its backpressure.

The service stages each engine step's records (``try_put``) and makes them visible with one
head update (``publish``). There is one code ring and one consumer, so a full ring holds up
every stream: ``wait_put`` publishes what is staged, then waits for space up to
``timeout_s``. It returns False if the ring stayed full, and the service decides what that
means (a CODES record fails its stream with ERROR "backpressure"; an END or ERROR stays
queued and is retried). A full ring never drops a record.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from llm_worker import metrics as M
from shm.ring import RingFull, RingWriter

Payload = bytes | bytearray | memoryview | np.ndarray


class RecordSink(Protocol):
    max_payload: int
    """The largest payload one record may carry (bytes)."""

    def try_put(self, kind: int, stream_id: int, seq: int, payload: Payload) -> bool:
        """Stage one record after the staged ones (the payload is copied); False if there
        is no room now."""

    async def wait_put(self, kind: int, stream_id: int, seq: int, payload: Payload) -> bool:
        """Publish what is staged, then stage the record once there is room; False if there
        was none for the sink's timeout (nothing was staged)."""

    def publish(self) -> None:
        """Make every staged record visible to the consumer at once."""


class RingSink:
    """Writes to the code ring (``RingWriter`` on the engine's ``layout.engine_code_ring(e)``)."""

    def __init__(self, writer: RingWriter, timeout_s: float) -> None:
        self._writer = writer
        self._timeout_s = timeout_s
        self.max_payload = writer.max_payload
        # The per-record calls of every step go straight to the writer (no wrapper call).
        self.try_put = writer.try_append
        self.publish = writer.publish

    async def wait_put(self, kind: int, stream_id: int, seq: int, payload: Payload) -> bool:
        t0 = time.perf_counter()
        try:
            await self._writer.append_async(kind, stream_id, seq, payload, self._timeout_s)
            return True
        except RingFull:
            return False
        finally:
            M.RING_WAIT_SECONDS.observe(time.perf_counter() - t0)
