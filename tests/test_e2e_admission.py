"""Learned admission against the real engine: `orpheus-serve serve` with vLLM on CPU (tiny
model) and SNAC, its default admission (``gateway.admission = "learned"``), flooded by more
closed-loop clients than the two-core machine plays in real time.

What it shows: the node learns a limit from the streams' audio (``orpheus_gateway_capacity``
at least 1 and below the flood), answers every request with audio or a 429 (never a 5xx,
never a stall), refuses at once (not after ``gateway.queue_timeout_s``) with Retry-After, and
holds no more streams at once than its limit lets in. Whether the admitted streams play in
real time depends on what else the machine runs (a CPU busy with other work plays nothing in
real time, at any limit): that is checked where the node's capacity is known
(tests/test_gateway_capacity.py, a synthetic node of capacity 8) and measured by
``orpheus-serve bench overload`` on a quiet machine (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from e2e_harness import Server, start_server, stop_server
from prometheus_client.parser import text_string_to_metric_families

from shm.records import SAMPLE_RATE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CLIENTS = 8
FLOOD_S = 20.0
FRAMES = 24  # ~2 s of audio a request


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[Server]:
    srv = start_server(tiny_model, admission="learned")
    yield srv
    assert stop_server(srv) == 0, "SIGTERM stops the server cleanly"
    assert srv.segments_left() == [], "shared-memory segments left behind"


async def _speak(
    s: aiohttp.ClientSession, url: str, i: int
) -> tuple[int, float, float, float, str]:
    """(status, time to the answer's head, TTFB, worst lag of the audio behind real time,
    Retry-After)."""
    body = {"model": "tts-1", "input": f"Sentence number {i}.", "voice": "tara",
            "response_format": "pcm", "max_tokens": 7 * FRAMES, "seed": i}  # fmt: skip
    t0 = time.monotonic()
    async with s.post(f"{url}/v1/audio/speech", json=body) as r:
        head = time.monotonic() - t0
        if r.status != 200:
            await r.read()
            return r.status, head, 0.0, 0.0, r.headers.get("Retry-After", "")
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
        return 200, head, (first or t0) - t0, worst, ""


async def _gauges(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    wanted = ("orpheus_gateway_capacity", "orpheus_gateway_active_streams")
    return {
        f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in wanted
    }


def test_a_flood_is_answered_at_once_and_admitted_streams_play(server: Server) -> None:
    results: list[tuple[float, tuple[int, float, float, float, str]]] = []
    samples: list[dict[str, float]] = []

    async def flood() -> None:
        stop = time.monotonic() + FLOOD_S
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def client(c: int) -> None:
                i = 0
                while time.monotonic() < stop:
                    res = await _speak(s, server.url, c * 1000 + i)
                    results.append((time.monotonic(), res))
                    i += 1
                    if res[0] == 429:
                        await asyncio.sleep(float(res[4] or 1))

            async def watch() -> None:
                while time.monotonic() < stop:
                    samples.append(await _gauges(s, server.url))
                    await asyncio.sleep(0.5)

            await asyncio.gather(watch(), *(client(c) for c in range(CLIENTS)))

    asyncio.run(flood())
    assert samples and all("orpheus_gateway_capacity" in g for g in samples), samples[:3]
    capacity = samples[-1]["orpheus_gateway_capacity"]
    assert 1 <= capacity < CLIENTS, capacity  # learned: below the flood, at least one
    # The node never holds more streams than the highest limit it has had (a limit that
    # falls stops admissions; it cuts nobody).
    highest = 0.0
    for g in samples:
        highest = max(highest, g["orpheus_gateway_capacity"])
        assert g["orpheus_gateway_active_streams"] <= highest, samples
    statuses = {r[0] for _, r in results}
    assert statuses <= {200, 429}, statuses
    refused = [r for _, r in results if r[0] == 429]
    played = [r for _, r in results if r[0] == 200]
    assert refused, "eight clients on two cores: some must be refused"
    assert all(r[4] for r in refused), "every 429 carries Retry-After"
    heads = sorted(r[1] for r in refused)
    assert heads[int(0.99 * (len(heads) - 1))] < 1.0, heads[-5:]
    assert played, "the node speaks while it refuses"
