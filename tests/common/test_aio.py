"""``common.aio.wait_event``: a timed wait that never drops a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from common.aio import wait_event


async def test_set_timed_out_and_already_set() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5) is True
    assert await wait_event(event, 0) is True  # set already: no wait, even with no time


@pytest.mark.parametrize("steps", range(4))
async def test_a_cancel_that_meets_the_set_is_raised(steps: int) -> None:
    """The event is set and the waiter cancelled ``steps`` loop steps later: whatever the
    step, the waiter ends cancelled. (``asyncio.wait_for`` on Python 3.11 returns True
    instead, for some steps.)"""

    async def waiter(event: asyncio.Event) -> None:
        while True:
            await wait_event(event, 30)
            event.clear()

    event = asyncio.Event()
    task = asyncio.get_running_loop().create_task(waiter(event))
    await asyncio.sleep(0.01)
    event.set()
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert done and task.cancelled()
