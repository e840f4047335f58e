"""Learned admission (``gateway.admission = "learned"``): the limit follows what the node holds
in real time, waiting is bounded by the TTFB budget, and keys are served fairly.

The model (``gateway.admission.capacity.CapacityModel``) is checked on its own: it converges on the load
whose real-time factor leaves the margin, rises at most by doubling, falls when the streams
slow down, and does not flap on noise. Through a gateway, the synthetic backend plays a node of
known capacity (``capacity=C``: each frame takes 85.3 ms * n / C with n streams open): under a
flood of closed-loop clients far above C the learned limit settles near C / (1 + margin), the
admitted streams stay real-time and the rest are refused at once; a key that floods does not
hold back another key's request; a key over its own limit hears
``too_many_concurrent_requests``, in ElevenLabs' shape on its routes.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator

import aiohttp
import pytest
from gateway_harness import NO_STORE, running_gateway, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.capacity import CapacityModel
from gateway.admission.queue import Admission, KeyLimits
from gateway.errors import APIError
from shm.admission import AdmissionBoard
from shm.config import ShmConfig
from shm.layout import InstanceLayout
from shm.records import SAMPLE_RATE
from shm.segments import create_instance, destroy_instance

pytestmark = pytest.mark.timeout(120)

MARGIN = 0.1


def model(upper: int = 256, initial: int = 2) -> CapacityModel:
    return CapacityModel(margin=MARGIN, start_budget_s=0.5, initial=initial, upper=upper)


STREAM_S = 2.0
"""How long each simulated stream lasts: a flood of ``n`` ends ``n / STREAM_S`` per second."""


def drive(
    m: CapacityModel,
    rtf_of_n,
    ticks: int,
    *,
    t0: float = 0.0,
    noise: float = 0.0,
    underrun_of_n=None,
    seed: int = 7,
):
    """Run the loop the gateway runs: the load is the limit (a flood), each tick one sample,
    and the streams that end, each of which underran with probability ``underrun_of_n(n)``
    (by default: when the load is slower than real time)."""
    trace = []
    rng = random.Random(seed)
    now = t0
    ending = 0.0
    for _ in range(ticks):
        n = m.limit
        rtf = rtf_of_n(n) * (1 + rng.uniform(-noise, noise))
        m.observe_ratio(n, 1.0 / rtf, now)
        m.observe_start(n, 0.05, now)
        ending += n * 0.25 / STREAM_S
        while ending >= 1.0:
            ending -= 1.0
            p = underrun_of_n(n) if underrun_of_n else float(rtf > 1.0)
            m.observe_end(n, rng.random() < p, now)
        trace.append(m.update(now))
        now += 0.25
    return trace


def test_the_limit_converges_on_the_load_that_leaves_the_margin() -> None:
    # A GPU-like engine: a fixed step cost plus a cost per stream; real time at n = 100.
    m = model()
    trace = drive(m, lambda n: 0.3 + 0.007 * n, 200)
    best = (1 / (1 + MARGIN) - 0.3) / 0.007  # 87.0
    assert abs(trace[-1] - best) <= 2, trace[-20:]
    # Slow start: from 2, each step at most doubles.
    assert all(b <= 2 * a for a, b in itertools.pairwise(trace))


def test_the_limit_falls_when_streams_slow_and_rises_again() -> None:
    m = model()
    drive(m, lambda n: n / 40, 120)  # holds 40 in real time
    high = m.limit
    assert 33 <= high <= 37
    # Something else takes half the machine: the same load is now twice as slow.
    drive(m, lambda n: n / 20, 120, t0=30)
    low = m.limit
    assert 16 <= low <= 19
    # It is gone again; the limit comes back as old evidence fades (HALF_LIFE_S).
    drive(m, lambda n: n / 40, 1200, t0=60)
    assert m.limit >= high - 3


def test_a_limit_held_under_a_slow_spell_probes_again_once_it_passes() -> None:
    m = model()
    drive(m, lambda n: n / 2.5, 120)  # a busy machine: one stream holds, two do not
    assert m.limit in (1, 2)
    # The spell passes; at the limit nothing above it is measured, so only a probe every
    # PROBE_S shows the machine holds more again.
    trace = drive(m, lambda n: n / 20, 4800, t0=30)
    assert trace[-1] >= 15, trace[::200]


def test_noise_does_not_make_the_limit_flap() -> None:
    m = model()
    trace = drive(m, lambda n: n / 30, 600, noise=0.05)
    settled = trace[200:]
    assert max(settled) - min(settled) <= 3, sorted(set(settled))
    changes = sum(1 for a, b in itertools.pairwise(settled) if a != b)
    assert changes <= 20, changes


def test_a_slow_start_time_bounds_the_limit_too() -> None:
    m = model()
    for _ in range(100):
        n = m.limit
        m.observe_ratio(n, 5.0, 0.0)  # generation is never the problem...
        m.observe_start(n, 0.02 * n, 0.0)  # ...but starts slow down: 0.5 s at n = 25
        for _ in range(8):
            m.observe_end(n, False, 0.0)  # (and nobody underruns)
        m.update(0.0)
    assert 20 <= m.limit <= 25


def test_a_load_whose_streams_underrun_bounds_the_limit_though_its_rate_looks_real_time() -> None:
    # The 2-core CPU's shape (docs/performance.md): the windows' rate stays above real time
    # at three streams, but 41% of those streams leave their players dry early on.
    m = model()
    trace = drive(
        m, lambda n: 0.25 * n, 2400, underrun_of_n=lambda n: 0.02 if n <= 2 else 0.41
    )  # 10 minutes
    settled = trace[240:]
    assert max(settled) <= 4, sorted(set(settled))
    assert sum(1 for x in settled if x == 2) >= 0.9 * len(settled), sorted(set(settled))
    # The load found bad is tried again ever less often (a backoff), not every few seconds.
    tries = [i for i, (a, b) in enumerate(itertools.pairwise(trace)) if b > 2 >= a]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert len(tries) <= 8, tries
    assert gaps == sorted(gaps) or max(gaps) >= 400, gaps  # 15 s, 30 s, ... up to PROBE_S


def test_a_cold_start_verdict_costs_seconds_not_minutes() -> None:
    # The first streams of a cold server underrun at any load; then the node holds four.
    m = model()
    cold = drive(m, lambda n: 0.2 * n, 20, underrun_of_n=lambda n: 1.0)  # 5 s
    assert cold[-1] == 1, cold
    warm = drive(m, lambda n: 0.2 * n, 480, t0=5.0)  # then 2 minutes
    assert warm.index(4) < 240, warm[::20]  # the limit is back to four within a minute


@settings(max_examples=200, deadline=None)
@given(
    upper=st.integers(1, 512),
    samples=st.lists(
        st.tuples(st.integers(1, 600), st.floats(0.0, 50.0), st.floats(0.0, 5.0)), max_size=60
    ),
)
def test_the_limit_stays_within_one_and_the_ceiling(
    upper: int, samples: list[tuple[int, float, float]]
) -> None:
    m = model(upper=upper)
    most = 1
    for i, (n, ratio, start) in enumerate(samples):
        most = max(most, n)
        before = m.limit
        m.observe_ratio(n, ratio, i * 0.25)
        m.observe_start(n, start, i * 0.25)
        after = m.update(i * 0.25)
        assert 1 <= after <= upper
        assert after <= max(before, 2 * most)  # never past twice a load it has seen


# -- admission with learned limits -----------------------------------------------------------
async def test_a_request_that_cannot_start_in_time_is_refused_at_once() -> None:
    adm = Admission(
        8, 64, 10.0, 1, lambda: None, learned=True, initial_limit=1, wait_budget=lambda: 0.2
    )
    engine = await adm.acquire()
    # Nothing has ended lately: one request may wait (it gets the TTFB budget), the next
    # could not start in time and hears so now, not after queue_timeout_s.
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        await adm.acquire()
    assert time.monotonic() - t0 < 0.05
    assert e.value.status == 429 and e.value.code == "server_busy"
    assert e.value.headers()["Retry-After"] == "1"
    with pytest.raises(APIError) as e:
        await waiter  # the budget passed: refused, not held 10 s
    assert e.value.code == "queue_timeout"
    # A request continuing an admitted stream (its next sentence) is never held back.
    assert await adm.acquire(continuing=True) == engine
    adm.release(engine)
    adm.release(engine)
    assert adm.active == 0 and adm.queued == 0


async def test_a_freed_slot_goes_to_the_key_that_holds_and_waits_least() -> None:
    adm = Admission(2, 64, 10.0, 1, lambda: None)
    await adm.acquire("a")
    await adm.acquire("a")
    flood = [asyncio.create_task(adm.acquire("a")) for _ in range(5)]
    await asyncio.sleep(0)
    other = asyncio.create_task(adm.acquire("b"))
    await asyncio.sleep(0)
    adm.release(0, "a")  # key b holds nothing: the slot is its, ahead of a's five
    await asyncio.sleep(0)
    assert other.done() and not any(t.done() for t in flood)
    adm.release(0, "a")  # b waits no more: a's oldest
    await asyncio.sleep(0)
    assert flood[0].done() and not any(t.done() for t in flood[1:])
    for t in flood[1:]:
        t.cancel()
    await asyncio.gather(*flood[1:], return_exceptions=True)
    adm.release(0, "a")
    adm.release(0, "b")
    assert adm.active == 0 and adm.queued == 0 and not adm.by_key


async def test_a_key_over_its_limit_is_refused_as_elevenlabs_names_it() -> None:
    adm = Admission(8, 8, 10.0, 1, lambda: None, key_limits=KeyLimits(2, {"big": 3}))
    for _ in range(2):
        await adm.acquire("k")
    with pytest.raises(APIError) as e:
        await adm.acquire("k")
    assert e.value.code == "too_many_concurrent_requests"
    assert e.value.headers()["maximum-concurrent-requests"] == "2"
    assert e.value.headers()["current-concurrent-requests"] == "2"
    assert b'"too_many_concurrent_requests"' in e.value.to_elevenlabs_json()
    for _ in range(3):
        await adm.acquire("big")
    await adm.acquire("other")


@settings(max_examples=150, deadline=None)
@given(
    learned=st.booleans(),
    per_key=st.integers(0, 3),
    ops=st.lists(
        st.tuples(st.sampled_from(["acquire", "release", "cancel", "learn"]), st.integers(0, 5)),
        max_size=60,
    ),
)
def test_slots_and_keys_add_up_whatever_happens(
    learned: bool, per_key: int, ops: list[tuple[str, int]]
) -> None:
    """Under any sequence of requests of three keys, releases, cancelled waiters and new
    limits: every held slot is counted once on its engine and its key, nothing is left
    queued that nobody waits for, and no key holds more than its limit."""

    async def run() -> None:
        adm = Admission(
            4, 6, 5.0, 1, lambda: None, engines=2, learned=learned, initial_limit=1,
            wait_budget=lambda: 5.0, key_limits=KeyLimits(per_key),
        )  # fmt: skip
        held: list[tuple[int, str]] = []
        waiting: list[tuple[asyncio.Task[int], str]] = []
        for op, arg in ops:
            key = "abc"[arg % 3]
            if op == "acquire":
                waiting.append((asyncio.create_task(adm.acquire(key)), key))
            elif op == "release" and held:
                engine, k = held.pop(arg % len(held))
                adm.release(engine, k)
            elif op == "cancel" and waiting:
                waiting[arg % len(waiting)][0].cancel()
            elif op == "learn":
                adm.learn([arg % 4, (arg + 1) % 4])
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            for t, k in list(waiting):
                if t.done():
                    waiting.remove((t, k))
                    if not t.cancelled() and t.exception() is None:
                        held.append((t.result(), k))
            assert adm.active == len(held) == sum(adm.by_key.values())
            assert sorted(adm.by_engine) == sorted(
                sum(1 for e, _ in held if e == i) for i in range(2)
            )
            assert adm.queued == len(waiting)
            if per_key:
                assert all(n <= per_key for n in adm.by_key.values())
        for t, _ in waiting:
            t.cancel()
        await asyncio.gather(*(t for t, _ in waiting), return_exceptions=True)
        for engine, k in held:
            adm.release(engine, k)
        assert adm.active == 0 and adm.queued == 0 and not adm.by_key

    asyncio.run(run())


@pytest.fixture
def node(layout: InstanceLayout) -> Iterator[InstanceLayout]:
    """An instance of two gateway processes' admission segment."""
    lay = InstanceLayout(instance=layout.instance, run_dir=layout.run_dir, gateways=2)
    create_instance(lay, ShmConfig(code_ring_bytes=64 << 10, pcm_ring_bytes=1 << 20))
    yield lay
    destroy_instance(lay)


async def test_gateway_processes_admit_to_the_lowest_fresh_opinion_per_engine(
    node: InstanceLayout,
) -> None:
    def gateway(index: int) -> Admission:
        return Admission(
            64, 8, 5.0, 1, lambda: None,
            board=AdmissionBoard(node.admission_segment, node.gateways, index),
            engines=2, learned=True, initial_limit=2, wait_budget=lambda: 0.0,
        )  # fmt: skip

    a, b = gateway(0), gateway(1)
    try:
        assert a.capacity() == 4  # slow start: 2 an engine before any evidence
        a.learn([10, 6])
        b.learn([0, 0])  # no fresh evidence of its own: it takes the node's
        assert b.limits == [10, 6] and b.capacity() == 16
        b.learn([7, 9])  # the lowest fresh opinion of each engine wins, in both processes
        a.learn([10, 6])
        assert a.limits == b.limits == [7, 6]
        for _ in range(7):
            await a.acquire()
        for _ in range(6):
            await b.acquire()
        assert sorted(a.by_engine[e] + b.by_engine[e] for e in (0, 1)) == [6, 7]
        with pytest.raises(APIError):  # the node is full: 13 streams on 7 + 6
            await b.acquire()
    finally:
        a.close()
        b.close()


# -- through a gateway, against a node of known capacity ------------------------------------
CAPACITY = 8
FRAMES = 24  # about 2 s of audio a request
FLOOD_S = 20.0
"""How long the flood lasts; its second half is judged."""


async def _speak(
    s: aiohttp.ClientSession, url: str, key: str, frames: int = FRAMES
) -> tuple[int, float, float, float]:
    """One request: (status, seconds to the answer's head, TTFB, worst lag behind real time
    of its audio, s: > 0 means a player with that much buffer would have run dry)."""
    body = {"model": "tts-1", "input": "x", "voice": "alloy", "response_format": "pcm",
            "max_tokens": 7 * frames}  # fmt: skip
    t0 = time.monotonic()
    async with s.post(
        f"{url}/v1/audio/speech", json=body, headers={"Authorization": f"Bearer {key}", **NO_STORE}
    ) as r:
        head = time.monotonic() - t0
        if r.status != 200:
            await r.read()
            return r.status, head, 0.0, 0.0
        first = None
        got = 0
        worst = 0.0
        async for chunk in r.content.iter_any():
            now = time.monotonic()
            if first is None:
                first = now
            else:
                worst = max(worst, (now - first) - got / 2 / SAMPLE_RATE)
            got += len(chunk)
        return 200, head, (first or t0) - t0, worst


Flood = tuple[
    list[tuple[int, float, float, float]], list[tuple[int, float, float, float]], list[int]
]
"""A flood's answers (the flood's, the calm key's) and the limit every 0.25 s."""
FLOOD_TRIES = 2
"""Floods run at most: the second only when the first's limit never settled at the node's
half (see the test)."""


async def _flood(layout: InstanceLayout) -> Flood:
    async with running_gateway(
        layout,
        backend={"realtime": True, "capacity": CAPACITY, "tick_s": 0.02},
        admission="learned",
        api_keys=["flood", "calm"],
    ) as h:
        results: list[tuple[int, float, float, float]] = []
        calm: list[tuple[int, float, float, float]] = []
        limits: list[int] = []
        stop = time.monotonic() + FLOOD_S
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def client(key: str, out: list[tuple[int, float, float, float]]) -> None:
                while time.monotonic() < stop:
                    res = await _speak(s, h.url, key)
                    out.append(res)
                    if res[0] == 429:
                        await asyncio.sleep(0.2)

            async def watch() -> None:
                while time.monotonic() < stop:
                    limits.append(h.gateway.admission.capacity())
                    await asyncio.sleep(0.25)

            # 24 flooding clients: three times what the node holds; one calm client.
            await asyncio.gather(
                watch(),
                client("calm", calm),
                *(client("flood", results) for _ in range(3 * CAPACITY)),
            )
        await wait_until(lambda: h.gateway.admission.active == 0, what="streams released")
    return results, calm, limits


async def test_a_flood_is_held_to_what_the_node_plays_in_real_time(
    layout: InstanceLayout,
) -> None:
    # A load found bad keeps the limit below it for a while (``capacity.BAD_MEMORY_S``), as
    # it should: a few seconds in which the shared test machine starves the node's process
    # make the streams at 3 late, and the limit then stays at 2 for the rest of a flood
    # (seen once in `make test`, three workers beside it: 2, then 3 for 2 s, then 2 for
    # 15 s). Such a flood says nothing of the node: it runs once more, and the assertions
    # below judge the last one. A limit that never settles twice is a failure.
    for _ in range(FLOOD_TRIES):
        results, calm, limits = await _flood(layout)
        settled = limits[len(limits) // 2 :]
        if settled and min(settled) >= CAPACITY // 2:
            break
        print(f"a flood whose limit never settled at {CAPACITY // 2}: {limits}")

    # The limit climbs by slow start (each rise proven by streams that ended in real time):
    # from 2 it passed CAPACITY // 2 5-5.5 s in on a quiet 2-core VM and beside six busy
    # loops, but in a clean clone's first run (.ci/run) it was at 3 in the second half of a
    # 14 s flood: the second half of 20 s leaves the climb 4.5 s more.
    settled = limits[len(limits) // 2 :]
    assert settled and min(settled) >= CAPACITY // 2 and max(settled) <= CAPACITY, (
        f"the limit every 0.25 s: {limits}"
    )
    played = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert played and refused, (len(played), len(refused))
    assert {r[0] for r in results} <= {200, 429}
    # Refusals are answered within the TTFB budget (1 s), not after queue_timeout_s (10 s);
    # a shared test machine's scheduling delays are allowed for (the bench measures p99).
    refusal_s = sorted(r[1] for r in refused)
    assert refusal_s[int(len(refusal_s) * 0.99) - 1] < 2.0, refusal_s[-5:]
    # Admitted after the limit settled (the second half): they play in real time. The bound
    # is what a shared 2-core machine allows the event loop that plays 25 clients and the
    # node: 30 of 35 (86%) in one `make test` with 2 other workers busy, where a node let in
    # at three times its capacity plays none in real time (the synthetic backend slows every
    # stream down). The bench, not this test, measures the share (bench overload).
    late = played[len(played) // 2 :]
    real_time = [r for r in late if r[2] < 1.0 and r[3] < 0.1]
    assert len(real_time) >= 0.75 * len(late), sorted(r[3] for r in late)
    # The calm key, one request at a time, is not starved by the flood.
    calm_played = [r for r in calm if r[0] == 200]
    assert len(calm_played) >= 0.5 * len(calm), calm


async def test_the_next_sentence_of_an_admitted_response_is_never_refused(
    layout: InstanceLayout,
) -> None:
    """An ElevenLabs HTTP response speaks one sentence after another, each admitted on its
    own: while the node is full (another request took the slot its first sentence freed) the
    response's later sentences are still admitted, over the limit, so an admitted stream is
    not cut."""
    async with (
        running_gateway(layout, backend={"realtime": True}, admission="learned") as h,
        aiohttp.ClientSession() as s,
    ):
        body = {"text": "Hello world. Bye now. See you.", "model_id": "eleven_turbo_v2_5"}
        url = h.url + "/v1/text-to-speech/tara/stream?output_format=pcm_24000"
        adm = h.gateway.admission
        over = 0

        async def eleven() -> tuple[int, bytes]:
            async with s.post(url, json=body) as r:
                return r.status, await r.read()

        async def watch() -> None:
            nonlocal over
            while True:
                over = max(over, adm.active - adm.capacity())
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        response = asyncio.create_task(eleven())
        await wait_until(lambda: adm.active == 1, what="first sentence")
        others = [asyncio.create_task(_speak(s, h.url, "", frames=60)) for _ in range(2)]
        status, audio = await response
        watcher.cancel()
        assert status == 200 and len(audio) == (12 + 8 + 8) * 2048 * 2  # every sentence
        assert over >= 1, "its later sentences were admitted over a full node's limit"
        assert {(await t)[0] for t in others} <= {200, 429}


async def test_a_keys_limit_is_answered_in_each_protocols_terms(layout: InstanceLayout) -> None:
    async with (
        running_gateway(
            layout, backend={"realtime": True}, api_keys=["k"], max_streams_per_key=1
        ) as h,
        aiohttp.ClientSession() as s,
    ):
        first = asyncio.create_task(_speak(s, h.url, "k", frames=40))
        await wait_until(lambda: h.gateway.admission.active == 1, what="the key's stream")
        body = {"text": "Hello there.", "model_id": "eleven_turbo_v2_5"}
        for path in ("/stream", ""):  # ElevenLabs' streaming and whole routes
            async with s.post(
                f"{h.url}/v1/text-to-speech/tara{path}", json=body, headers={"xi-api-key": "k"}
            ) as r:
                assert r.status == 429
                assert r.headers["Retry-After"] == "1"
                assert r.headers["current-concurrent-requests"] == "1"
                assert r.headers["maximum-concurrent-requests"] == "1"
                detail = (await r.json())["detail"]
                assert detail["status"] == "too_many_concurrent_requests", detail
        status = await _speak(s, h.url, "k")  # the OpenAI route: its own shape, same code
        assert status[0] == 429
        async with s.post(
            f"{h.url}/v1/audio/speech",
            json={"model": "tts-1", "input": "x", "voice": "alloy"},
            headers={"Authorization": "Bearer k"},
        ) as r:
            assert (await r.json())["error"]["code"] == "too_many_concurrent_requests"
        assert (await first)[0] == 200


def test_an_engine_that_cannot_hold_one_stream_says_how_short_it_falls() -> None:
    m = model()
    drive(m, lambda n: 1.6 * n, 120)  # one stream alone plays at 1/1.6 of real time
    assert m.limit == 1
    held = m.below_one(30.0)
    assert held is not None and abs(held - (1 / (1 + MARGIN)) / 1.6) < 0.02, held
    drive(m, lambda n: 0.25 * n, 2400, t0=30.0)  # the machine is free again
    assert m.below_one(630.0) is None and m.limit >= 2


class _SlowStream:
    """A stream whose audio arrives at ``speed`` times real time (the controller's view)."""

    def __init__(self, speed: float, now: float) -> None:
        self.engine = 0
        self.opened_at = now
        self.first_audio_at: float | None = now + 0.1
        self.first_chunk_bytes = 4096
        self.bytes_received = 4096
        self.min_lead_s = 0.0
        self.last_record_at = now
        self.text_closed = True
        self.ended = False
        self.speed = speed

    def advance(self, now: float, dt: float) -> None:
        self.bytes_received += int(self.speed * dt * 2 * SAMPLE_RATE)
        self.last_record_at = now
        played = now - (self.first_audio_at or now)
        self.min_lead_s = min(self.min_lead_s, self.bytes_received / 2 / SAMPLE_RATE - played)


def test_a_node_too_slow_for_one_stream_says_so_once_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gateway.admission.capacity import CapacityController

    c = CapacityController(
        1, margin=MARGIN, ttfb_budget_s=1.0, initial=1, upper=8, bytes_per_second=2 * SAMPLE_RATE
    )
    now = 0.0
    with caplog.at_level("INFO", logger="gateway.admission.capacity"):
        for _ in range(20):  # twenty streams one after another, each at 0.6 x real time
            s = _SlowStream(0.6, now)
            for _ in range(12):
                now += 0.25
                s.advance(now, 0.25)
                c.tick([s], [1], now)
            s.ended = True
            c.tick([], [0], now)
    held = c.below_one[0]
    assert held is not None and 0.3 < held < 0.7, held
    said = [r for r in caplog.records if "cannot hold one stream in real time" in r.message]
    assert len(said) == 1 and said[0].levelname == "WARNING", [r.message for r in said]


async def test_a_node_too_slow_for_one_stream_shows_it_in_the_capacity_gauge(
    layout: InstanceLayout, caplog: pytest.LogCaptureFixture
) -> None:
    """A node that plays one stream at half real time (``capacity=0.5``): one client speaking
    one request after another; the capacity gauge falls below 1 to about what one stream
    gets of its bound (0.5 / 1.1), and the gateway says so once."""
    from prometheus_client.parser import text_string_to_metric_families

    async with (
        running_gateway(
            layout, backend={"realtime": True, "capacity": 0.5, "tick_s": 0.02},
            admission="learned",
        ) as h,
        aiohttp.ClientSession() as s,
    ):  # fmt: skip

        async def gauge() -> float:
            async with s.get(f"{h.url}/metrics") as r:
                text = await r.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "orpheus_gateway_capacity":
                        return sample.value
            raise AssertionError("no orpheus_gateway_capacity")

        assert await gauge() >= 1
        with caplog.at_level("INFO", logger="gateway.admission.capacity"):
            deadline = time.monotonic() + 40
            while (value := await gauge()) >= 1:
                assert time.monotonic() < deadline, "the gauge never fell below 1"
                assert (await _speak(s, h.url, "", frames=12))[0] == 200
    assert 0.3 <= value <= 0.6, value
    said = [r for r in caplog.records if "cannot hold one stream in real time" in r.message]
    assert len(said) == 1, [r.message for r in caplog.records]
