"""Fair shares of a full node between API keys (issue 60).

``gateway.admission.shares.fair_shares`` is checked on its own for the max-min invariants (the shares
sum to at most the capacity, and to all of it or every demand; no key gets more than it
asks; a key held below its demand has the highest share per weight of all). Through
``gateway.admission.queue.Admission``: a key over its share is refused ``too_many_concurrent_requests``
with the longer Retry-After while a key under its share waits or is owed, a freed slot goes
to the key under its share (and is held for one refused lately until its client is back),
the turns alternate on a node that holds one stream, the weights move the shares, and a
key's refusal in one gateway process counts in the other.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
from gateway_harness import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.queue import SHARE_RETRY_FACTOR, Admission, KeyLimits
from gateway.admission.shares import fair_shares
from gateway.errors import APIError
from shm.admission import AdmissionBoard
from shm.config import ShmConfig
from shm.layout import InstanceLayout
from shm.segments import create_instance, destroy_instance

pytestmark = pytest.mark.timeout(60)

EPS = 1e-9


@settings(max_examples=400, deadline=None)
@given(
    capacity=st.integers(0, 64),
    keys=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 10.0])),
        max_size=12,
    ),
)
def test_shares_are_max_min_fair(capacity: int, keys: list[tuple[int, float]]) -> None:
    demands = [d for d, _ in keys]
    weights = [w for _, w in keys]
    shares = fair_shares(capacity, demands, weights)
    assert len(shares) == len(keys)
    assert sum(shares) <= capacity + EPS
    assert all(0 <= s <= d + EPS for s, d in zip(shares, demands, strict=True))
    # Nothing is left unused while a key wants more.
    assert math.isclose(sum(shares), min(capacity, sum(demands)), abs_tol=1e-6)
    # Max-min: a key held below its demand has at least every other key's share per weight.
    for i, (s, d, w) in enumerate(zip(shares, demands, weights, strict=True)):
        if s < d - 1e-6:
            for j, (t, v) in enumerate(zip(shares, weights, strict=True)):
                assert i == j or s / w >= t / v - 1e-6, (i, j, shares, demands, weights)


def test_shares_split_by_weight_and_give_up_what_a_key_leaves() -> None:
    assert fair_shares(4, [10, 10], [1.0, 1.0]) == [2.0, 2.0]
    assert fair_shares(4, [10, 10], [3.0, 1.0]) == [3.0, 1.0]
    assert fair_shares(6, [1, 10, 10], [1.0, 1.0, 1.0]) == [1.0, 2.5, 2.5]
    assert fair_shares(1, [16, 1], [1.0, 1.0]) == [0.5, 0.5]
    assert fair_shares(3, [0, 2], [1.0, 1.0]) == [0.0, 2.0]


def adm(max_active: int, **kw) -> Admission:
    """A node of ``max_active`` slots (the fixed limit), waits up to ``wait`` s."""
    wait = kw.pop("wait", 5.0)
    return Admission(max_active, 16, wait, 1, lambda: None, **kw)


async def test_a_key_over_its_share_is_refused_while_another_waits_for_its_turn() -> None:
    a = adm(1)
    await a.acquire("flood")
    light = asyncio.create_task(a.acquire("light"))
    await wait_until(lambda: a.queued == 1, what="the light key waiting")
    with pytest.raises(APIError) as e:
        await a.acquire("flood")
    assert (e.value.status, e.value.code) == (429, "too_many_concurrent_requests")
    h = e.value.headers()
    assert h["Retry-After"] == str(SHARE_RETRY_FACTOR)
    assert (h["current-concurrent-requests"], h["maximum-concurrent-requests"]) == ("1", "1")
    assert a.shares == {"flood": 0.5, "light": 0.5}
    a.release(0, "flood")
    assert await asyncio.wait_for(light, 1.0) == 0
    # Now the light key holds the node: the flood's next request waits its turn, the light
    # key's second is the one over its share.
    flood = asyncio.create_task(a.acquire("flood"))
    await wait_until(lambda: a.queued == 1, what="the flood waiting")
    with pytest.raises(APIError) as e:
        await a.acquire("light")
    assert e.value.code == "too_many_concurrent_requests"
    a.release(0, "light")
    await asyncio.wait_for(flood, 1.0)
    a.release(0, "flood")
    assert a.active == 0 and a.queued == 0


async def test_a_freed_slot_is_held_for_a_key_refused_lately() -> None:
    """The light key's request found the node full and gave up (its wait budget); it sleeps
    out its Retry-After. The slot the flood frees meanwhile is not the flood's: its next
    request waits, and the light key's retry takes the slot at once."""
    a = adm(1, wait=0.05)
    await a.acquire("flood")
    with pytest.raises(APIError) as e:
        await a.acquire("light")
    assert e.value.code == "queue_timeout"
    a.release(0, "flood")
    flood = asyncio.create_task(a.acquire("flood"))
    await asyncio.sleep(0.01)
    assert not flood.done() and a.active == 0, "the free slot is held for the light key"
    assert await a.acquire("light") == 0
    with pytest.raises(APIError) as e:
        await flood  # its wait budget passed while the light key played
    assert e.value.code == "queue_timeout"
    a.release(0, "light")


@pytest.mark.parametrize(
    ("weights", "light_clients", "light_part"),
    [({}, 1, 0.5), ({}, 4, 0.5), ({"light": 3.0}, 4, 0.75)],
)
async def test_turns_on_a_node_that_holds_one_stream_follow_the_weights(
    weights: dict[str, float], light_clients: int, light_part: float
) -> None:
    """Sixteen clients of one key against one or four of another, each back at once when its
    stream ends: the node's streams go in turns, not sixteen to one; with weights 3:1 three
    turns to one (a key whose one client is between two requests has nobody waiting: the
    slot goes on)."""
    a = adm(1, wait=30.0, key_weights=weights)
    served: list[str] = []
    stop = False

    async def client(key: str) -> None:
        while not stop:
            try:
                engine = await a.acquire(key)
            except APIError as e:
                await asyncio.sleep(0.001 * (e.retry_after_s or 1))
                continue
            served.append(key)
            await asyncio.sleep(0.002)
            a.release(engine, key)

    tasks = [asyncio.create_task(client("flood")) for _ in range(16)]
    tasks += [asyncio.create_task(client("light")) for _ in range(light_clients)]
    await wait_until(lambda: len(served) >= 40, what="40 streams served")
    stop = True
    served = served[:40]  # the flood's waiters are served after the light client stopped
    a.refuse_waiting(APIError(503, "draining", "test over"))
    await asyncio.gather(*tasks)
    light = served.count("light") / len(served)
    assert abs(light - light_part) <= 0.1, " ".join(k[0] for k in served)


async def test_a_key_that_comes_straight_back_keeps_the_slot_its_stream_frees_on_its_turn() -> None:
    """Issue 60's run: one light client, back as soon as its stream ends, against a flood
    whose streams last longer than the light request's wait budget. On the light key's turn,
    the slot its stream frees is held for its next request (``RETURN_GRACE_S``) instead of
    going to the flood's waiter in the milliseconds between the light client's two requests;
    a key not known to come straight back holds nothing, and the grace runs out."""
    a = adm(1)
    for _ in range(3):  # the flood was admitted more lately: the turns favour the light key
        a.release(await a.acquire("flood"), "flood")
    await a.acquire("light")
    flood = asyncio.create_task(a.acquire("flood"))
    await wait_until(lambda: a.queued == 1, what="the flood waiting")
    # The light key's first stream end: nothing is known of its client yet.
    a.release(0, "light")
    assert await asyncio.wait_for(flood, 1.0) == 0
    light = asyncio.create_task(a.acquire("light"))  # back at once: it comes straight back
    await wait_until(lambda: a.queued == 1, what="the light key waiting")
    a.release(0, "flood")
    assert await asyncio.wait_for(light, 1.0) == 0
    flood = asyncio.create_task(a.acquire("flood"))
    await wait_until(lambda: a.queued == 1, what="the flood waiting")
    # Its second stream end, on its turn (admitted 2 against the flood's 4): held for it.
    a.release(0, "light")
    await asyncio.sleep(0.02)
    assert not flood.done() and a.active == 0, "the slot is held for the light client"
    assert await a.acquire("light") == 0
    # Its third, not back within the grace: the flood's waiter takes the slot after it.
    a.release(0, "light")
    assert not flood.done()
    assert await asyncio.wait_for(flood, 1.0) == 0
    a.release(0, "flood")
    assert a.active == 0 and a.queued == 0


async def test_weights_move_the_shares() -> None:
    """Four slots, both keys wanting more: equal weights give each two, weights 3:1 three and
    one, so a slot the flood frees stays with it."""
    for weights, second in (({}, "light"), ({"flood": 3.0}, "flood")):
        a = adm(4, key_weights=weights)
        for _ in range(3):
            await a.acquire("flood")
        await a.acquire("light")
        waiters = {k: asyncio.create_task(a.acquire(k)) for k in ("flood", "light")}
        await wait_until(lambda a=a: a.queued == 2, what="both keys waiting")
        a.release(0, "flood")
        await asyncio.sleep(0)
        assert waiters[second].done() and not waiters[_other(second)].done(), weights
        a.refuse_waiting(APIError(503, "draining", "test over"))
        await asyncio.gather(*waiters.values(), return_exceptions=True)


def _other(key: str) -> str:
    return "light" if key == "flood" else "flood"


async def test_a_single_key_is_served_as_before() -> None:
    """With one key no share applies: the node's refusal is ``server_busy``."""
    a = Admission(1, 0, 5.0, 1, lambda: None)
    await a.acquire("only")
    with pytest.raises(APIError) as e:
        await a.acquire("only")
    assert e.value.code == "server_busy" and e.value.headers()["Retry-After"] == "1"
    assert a.shares == {}


@pytest.fixture
def node(layout: InstanceLayout) -> Iterator[InstanceLayout]:
    lay = InstanceLayout(instance=layout.instance, run_dir=layout.run_dir, gateways=2)
    create_instance(lay, ShmConfig(code_ring_bytes=64 << 10, pcm_ring_bytes=1 << 20))
    yield lay
    destroy_instance(lay)


async def test_a_refusal_in_one_gateway_process_counts_in_the_other(node: InstanceLayout) -> None:
    """The light key was refused in process 1; in process 0 the flood's request meets the
    light key's demand through the board and is refused for its share, and the slot the
    flood frees in process 0 stays free for the light key's retry in process 1."""

    def gateway(index: int) -> Admission:
        board = AdmissionBoard(node.admission_segment, node.gateways, index)
        return Admission(1, 16, 0.05, 1, lambda: None, board)

    a, b = gateway(0), gateway(1)
    try:
        await a.acquire("flood")
        with pytest.raises(APIError) as e:
            await b.acquire("light")
        assert e.value.code == "queue_timeout"
        with pytest.raises(APIError) as e:
            await a.acquire("flood")
        assert e.value.code == "too_many_concurrent_requests"
        a.release(0, "flood")
        with pytest.raises(APIError):
            await a.acquire("flood")  # waits its budget: the slot is the light key's
        assert await b.acquire("light") == 0
        b.release(0, "light")
    finally:
        a.close()
        b.close()


async def test_the_next_sentences_of_a_response_do_not_count_in_its_keys_turns() -> None:
    """Keys a and b each had one stream admitted (a first, then b), a's response with three
    more sentences (``continuing``). When both wait for the slot c frees, a's turn comes
    first: its sentences are one stream, not four."""
    a = adm(1)
    engine = await a.acquire("a")
    for _ in range(3):
        a.release(engine, "a")
        engine = await a.acquire("a", continuing=True)
    a.release(engine, "a")
    a.release(await a.acquire("b"), "b")
    await a.acquire("c")
    first = asyncio.create_task(a.acquire("a"))
    second = asyncio.create_task(a.acquire("b"))
    await wait_until(lambda: a.queued == 2, what="a and b waiting")
    a.release(0, "c")
    await asyncio.sleep(0)
    assert first.done() and not second.done()
    a.release(0, "a")
    await asyncio.wait_for(second, 1.0)
    a.release(0, "b")


# -- streams served from the sentence audio cache (``hold_key``) -----------------------------
async def test_a_key_s_cache_hits_do_not_count_in_its_turns_nor_its_share() -> None:
    """The agent's callers hear two cached greetings (no engine slot) when it and a third key
    wait for the slot the other frees: the agent, first in line, holds no slot, so its turn
    comes first; counted as streams held, its hits would have put it behind."""
    a = adm(1)
    await a.acquire("other")
    a.hold_key("agent")
    a.hold_key("agent")
    agent = asyncio.create_task(a.acquire("agent"))
    await wait_until(lambda: a.queued == 1, what="the agent waiting")
    third = asyncio.create_task(a.acquire("third"))
    await wait_until(lambda: a.queued == 2, what="the third key waiting")
    assert a.shares == pytest.approx({"other": 1 / 3, "agent": 1 / 3, "third": 1 / 3})
    a.release(0, "other")
    assert await asyncio.wait_for(agent, 1.0) == 0
    assert not third.done()
    a.release(0, "agent")
    assert await asyncio.wait_for(third, 1.0) == 0
    a.release(0, "third")
    a.release_key("agent")
    a.release_key("agent")
    assert a.active == 0 and not a.by_key and not a.slotless_by_key


async def test_cache_hits_in_one_gateway_process_count_in_the_key_s_limit_in_the_other(
    node: InstanceLayout,
) -> None:
    """``max_streams_per_key`` is the node's: hits held in process 0 (published on the board
    as the key's slotless streams) refuse the key's third stream in process 1."""

    def gateway(index: int) -> Admission:
        board = AdmissionBoard(node.admission_segment, node.gateways, index)
        return Admission(4, 16, 0.05, 1, lambda: None, board, key_limits=KeyLimits(2))

    a, b = gateway(0), gateway(1)
    try:
        a.hold_key("k")
        assert await b.acquire("k") == 0
        with pytest.raises(APIError) as e:
            await b.acquire("k")
        assert e.value.code == "too_many_concurrent_requests"
        with pytest.raises(APIError):
            a.hold_key("k")
        a.release_key("k")
        assert await b.acquire("k") == 0  # the hit's end is published too
        b.release(0, "k")
        b.release(0, "k")
    finally:
        a.close()
        b.close()
