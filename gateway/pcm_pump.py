"""The one task that drains a gateway's PCM ring into the stream registry."""

from __future__ import annotations

import asyncio
import logging

from gateway.streams import StreamRegistry
from shm.ring import RingReader

log = logging.getLogger(__name__)

MAX_RECORDS_PER_POLL = 4096
IDLE_WAIT_S = 1.0


async def pump_pcm(reader: RingReader, registry: StreamRegistry) -> None:
    """Poll, dispatch, release; sleep on the doorbell when the ring is empty.

    After each batch the task yields once so that the consumers it woke write their audio
    before the next batch is copied in (latency over batching: the ring absorbs bursts).
    """
    loop = asyncio.get_running_loop()
    poll = reader.poll
    release = reader.release
    dispatch = registry.dispatch
    while True:
        records = poll(MAX_RECORDS_PER_POLL)
        if records:
            try:
                dispatch(records, loop.time())
            except Exception:  # a bug here must not stop audio for every other stream
                log.exception("PCM dispatch failed; dropping %d records", len(records))
            finally:
                release()  # payload views are dead from here: dispatch copied what it keeps
            await asyncio.sleep(0)
        else:
            await reader.wait_async(IDLE_WAIT_S)
