"""The sentence audio cache on the real server (tiny model, real sampling, two gateway
processes sharing the node's cache): a repeated sentence comes back byte-identical to the
answer that was stored, whichever gateway process serves it, while the model's sampling
(no seed) would make each synthesis differ; another key never hears it; ``no-store`` never
reads it; twins asked of both processes at once are one synthesis (single flight across the
node). Latency is the bench's (docs/performance.md), not asserted here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from e2e_harness import Server, start_server, stop_server

pytestmark = pytest.mark.timeout(300)

TEXT = "Thank you for calling, how can I help you today?"
FRAMES = 12
"""About a second of audio a synthesis (``max_tokens``): short on a 2-core CPU."""


@pytest.fixture(scope="module")
def entries(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's cache directory."""
    return tmp_path_factory.mktemp("cache") / "entries"


@pytest.fixture(scope="module")
def server(tiny_model: Path, entries: Path) -> Iterator[Server]:
    cfg = entries.parent / "cache.toml"
    cfg.write_text(
        '[gateway]\napi_keys = ["k1", "k2"]\nprocesses = 2\n\n'
        f'[cache]\nenabled = true\ndir = "{entries}"\n'
    )
    srv = start_server(tiny_model, "--config", str(cfg))
    yield srv
    if srv.proc.poll() is None:
        assert stop_server(srv) == 0
    assert srv.segments_left() == []


async def _speak(
    s: aiohttp.ClientSession, url: str, key: str, cache_control: str | None = None
) -> tuple[str | None, bytes]:
    headers = {"Authorization": f"Bearer {key}"}
    if cache_control:
        headers["Cache-Control"] = cache_control
    body = {"model": "tts-1", "input": TEXT, "voice": "tara", "response_format": "pcm",
            "max_tokens": 7 * FRAMES}  # fmt: skip
    async with s.post(f"{url}/v1/audio/speech", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return r.headers.get("X-Cache"), await r.read()


def _wait_stores(srv: Server, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while srv.metric("orpheus_gateway_cache_stores_total") < n:
        assert time.monotonic() < deadline, "the second synthesis was not stored"
        time.sleep(0.1)


def test_a_repeat_is_byte_identical_to_the_stored_answer_in_every_gateway(server: Server) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            assert (await _speak(s, server.url, "k1"))[0] == "miss"
            state, stored = await _speak(s, server.url, "k1")
            assert state == "miss" and len(stored) == FRAMES * 2048 * 2
            _wait_stores(server, 1)
            # Eight repeats, spread over both gateway processes by the kernel (SO_REUSEPORT):
            # each one the stored bytes.
            for _ in range(8):
                async with aiohttp.ClientSession() as fresh:  # a new connection each
                    assert await _speak(fresh, server.url, "k1") == ("hit", stored)
            assert server.metric("orpheus_gateway_cache_lookups_total", result="hit") == 8
            # Another key says the same: synthesised for it.
            assert (await _speak(s, server.url, "k2"))[0] == "miss"
            # no-store reads nothing, no-cache synthesises again.
            assert (await _speak(s, server.url, "k1", "no-store"))[0] == "miss"
            state, fresh_audio = await _speak(s, server.url, "k1", "no-cache")
            assert state == "miss" and len(fresh_audio) == len(stored)

    asyncio.run(run())


FLIGHT_FRAMES = 48
"""Long enough a synthesis (about 4 s of audio) for eleven twins to arrive while it is made."""


def test_twins_in_both_gateway_processes_synthesise_once(server: Server, entries: Path) -> None:
    """Twelve requests of a new sentence, from twelve connections (the kernel spreads them
    over both gateway processes): the first synthesises, the eleven asked while it is made
    follow it, in its process or the other's (its log, gateway/cache/flight.py), and every
    answer is its bytes."""
    text = "Your call is important to us, please stay on the line."
    body = {"model": "tts-1", "input": text, "voice": "tara", "response_format": "pcm",
            "max_tokens": 7 * FLIGHT_FRAMES}  # fmt: skip
    headers = {"Authorization": "Bearer k1"}

    async def speak() -> tuple[str | None, bytes]:
        async with (
            aiohttp.ClientSession() as fresh,
            fresh.post(f"{server.url}/v1/audio/speech", json=body, headers=headers) as r,
        ):
            assert r.status == 200, await r.text()
            return r.headers.get("X-Cache"), await r.read()

    async def run() -> None:
        joins = server.metric("orpheus_gateway_cache_lookups_total", result="join")
        first = asyncio.create_task(speak())
        deadline = time.monotonic() + 30
        while not list(entries.glob("*/*.flight")):  # the first is synthesising
            assert time.monotonic() < deadline and not first.done(), "no flight began"
            await asyncio.sleep(0.005)
        twins = await asyncio.gather(*(speak() for _ in range(11)))
        state, audio = await first
        assert state == "miss" and len(audio) == FLIGHT_FRAMES * 2048 * 2
        assert twins == [("hit", audio)] * 11
        total = server.metric("orpheus_gateway_cache_lookups_total", result="join")
        assert total - joins == 11  # one synthesis node-wide

    asyncio.run(run())
