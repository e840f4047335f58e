"""Early refusals (``gateway.early_refusal``, issue 60): a key refused on arrival for the node
(``server_busy``) or for its share (``too_many_concurrent_requests``) hears the same 429 before
its next request's body is read, while nothing happened that could let such a request in.

Through ``Admission``: the refusal is repeated for the refused key only, with its code and
Retry-After, and counts as the key's demand; a freed slot, a waiter leaving the queue and the
time limit end it; off, nothing is repeated. An invariant (hypothesis): whenever
``refuse_early`` refuses, ``acquire`` at that moment refuses too. Through the HTTP app: a
body that is not even JSON hears the key's 429 while the node is full, and its 400 once a
slot is free, and another key's is read as before.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from gateway_harness import running_gateway, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config.cache import CacheConfig
from gateway.admission import queue as admission_module
from gateway.admission.queue import SHARE_RETRY_FACTOR, Admission, KeyLimits
from gateway.errors import APIError
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)


def adm(max_active: int, max_queued: int = 0, *, early: bool = True, **kw) -> Admission:
    """A node of ``max_active`` slots (the fixed limit), ``max_queued`` waiters."""
    wait = kw.pop("wait", 5.0)
    return Admission(max_active, max_queued, wait, 1, lambda: None, early_refusal=early, **kw)


async def refused(a: Admission, key: str) -> APIError:
    with pytest.raises(APIError) as e:
        await a.acquire(key)
    return e.value


async def test_a_full_node_repeats_its_refusal_to_the_refused_key_until_a_slot_frees() -> None:
    a = adm(1)
    assert a.refuse_early("k") is None, "nothing refused yet"
    await a.acquire("k")
    first = await refused(a, "k")
    assert (first.status, first.code) == (429, "server_busy")
    again = a.refuse_early("k")
    assert again is not None and again is not first
    assert (again.status, again.code, again.headers()["Retry-After"]) == (429, "server_busy", "1")
    assert a.refuse_early("other") is None, "only the key that was refused"
    assert a.early_refusals == 1
    a.release(0, "k")
    assert a.refuse_early("k") is None, "a slot freed: read the request"
    assert await a.acquire("k") == 0
    a.release(0, "k")


async def test_off_nothing_is_repeated() -> None:
    a = adm(1, early=False)
    await a.acquire("k")
    await refused(a, "k")
    assert a.refuse_early("k") is None
    a.release(0, "k")


async def test_a_key_over_its_share_hears_it_again_and_it_counts_as_demand() -> None:
    a = adm(1, max_queued=16)
    await a.acquire("flood")
    light = asyncio.create_task(a.acquire("light"))
    await wait_until(lambda: a.queued == 1, what="the light key waiting")
    first = await refused(a, "flood")
    assert first.code == "too_many_concurrent_requests"
    owed = a._owed_of("flood", 0)
    again = a.refuse_early("flood")
    assert again is not None and again.code == "too_many_concurrent_requests"
    assert again.headers()["Retry-After"] == str(SHARE_RETRY_FACTOR)
    assert a._owed_of("flood", 0) == owed, "the early refusal's client is owed as the first's"
    assert a.refuse_early("light") is None
    a.release(0, "flood")
    assert await asyncio.wait_for(light, 1.0) == 0
    assert a.refuse_early("flood") is None
    a.release(0, "light")


async def test_a_waiter_leaving_the_queue_or_the_time_limit_ends_the_repetition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = adm(1, max_queued=1, wait=0.05)
    await a.acquire("k")
    waiter = asyncio.create_task(a.acquire("k"))
    await wait_until(lambda: a.queued == 1, what="one waiting")
    assert (await refused(a, "k")).code == "server_busy"  # the queue is full
    assert a.refuse_early("k") is not None
    with pytest.raises(APIError):
        await waiter  # queue_timeout: the queue has room again
    assert a.refuse_early("k") is None
    monkeypatch.setattr(admission_module, "EARLY_REFUSAL_S", 0.02)
    b = adm(1)
    await b.acquire("k")
    await refused(b, "k")
    assert b.refuse_early("k") is not None
    await asyncio.sleep(0.03)
    assert b.refuse_early("k") is None
    a.release(0, "k")
    b.release(0, "k")


OPS = st.lists(
    st.tuples(st.sampled_from(["acquire", "release", "early"]), st.sampled_from("abc")),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 3),
    key_limit=st.integers(0, 2),
    ops=OPS,
)
def test_an_early_refusal_is_one_acquire_would_give(
    capacity: int, key_limit: int, ops: list[tuple[str, str]]
) -> None:
    """Fixed limit, no queue (every ``acquire`` answers at once): after any history of
    admissions, refusals and releases between three keys, a request ``refuse_early`` refuses
    is one ``acquire`` refuses at that moment, with the same code."""

    async def run() -> None:
        a = adm(capacity, key_limits=KeyLimits(key_limit))
        held: dict[str, int] = {}
        for op, key in ops:
            if op == "acquire":
                try:
                    await a.acquire(key)
                    held[key] = held.get(key, 0) + 1
                except APIError:
                    pass
            elif op == "release" and held.get(key):
                a.release(0, key)
                held[key] -= 1
            elif op == "early" and (early := a.refuse_early(key)) is not None:
                with pytest.raises(APIError) as e:
                    await a.acquire(key)
                assert e.value.code == early.code
        for key, n in held.items():
            for _ in range(n):
                a.release(0, key)
        assert a.active == 0

    asyncio.run(run())


def speech(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_over_http_a_refused_key_is_answered_before_its_body_is_read(
    layout: InstanceLayout,
) -> None:
    async with (
        running_gateway(
            layout, backend={"realtime": True}, max_active_streams=1, max_queued_streams=0,
            admission="fixed", api_keys=["flood", "other"], early_refusal=True,
            serve={"cache": CacheConfig(enabled=False)},  # the early refusal is off with the cache
        ) as h,
        aiohttp.ClientSession() as s,
    ):  # fmt: skip
        url = f"{h.url}/v1/audio/speech"
        ok = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "max_tokens": 7 * 30}
        hold = await s.post(url, json=ok, headers=speech("flood"))
        assert hold.status == 200
        await wait_until(lambda: h.gateway.admission.active == 1, what="the slot held")
        async with s.post(url, json=ok, headers=speech("flood")) as r:
            assert r.status == 429 and (await r.json())["error"]["code"] == "server_busy"
        # Not JSON: only a request whose body is not read hears 429 for it.
        async with s.post(url, data=b"not json", headers=speech("flood")) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "server_busy"
        async with s.post(url, data=b"not json", headers=speech("other")) as r:
            assert r.status == 400, "another key's request is read"
        assert h.gateway.admission.early_refusals == 1
        assert (
            h.metric("orpheus_gateway_requests_total", {"api": "http", "outcome": "rejected"}) == 2
        )
        await hold.read()
        hold.release()
        await wait_until(lambda: h.gateway.admission.active == 0, what="the slot freed")
        async with s.post(url, data=b"not json", headers=speech("flood")) as r:
            assert r.status == 400, "a slot freed: the request is read again"
