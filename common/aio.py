"""asyncio waits that keep a cancellation.

On Python 3.11, ``asyncio.wait_for(event.wait(), t)`` drops a ``cancel()`` that arrives in
the loop step where the event is set: it returns the event's result instead of raising
``CancelledError`` (fixed in 3.12, where ``wait_for`` is built on ``asyncio.timeout``). A
loop that waits so on a wake event and is cancelled at shutdown runs on, and whoever awaits
it waits for ever. ``asyncio.timeout`` counts cancellations and re-raises them; every timed
wait of the server goes through it.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes: True when it was set. A
    cancellation always propagates."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
