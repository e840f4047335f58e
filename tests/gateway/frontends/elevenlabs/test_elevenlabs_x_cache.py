"""``X-Cache`` on ElevenLabs' HTTP routes, read through the official ``elevenlabs`` SDK's raw
responses (its defaults but the PCM format): a whole answer's (``convert``,
``convert_with_timestamps``, text-to-dialogue ``.../with-timestamps``) is of all its
sentences, a streamed answer's of the sentences spoken before its first bytes (the first
one); no header with the cache off. The cache stores a unit on its first synthesis here
(``admit_after = 1``)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from elevenlabs import AsyncElevenLabs
from elevenlabs.types import DialogueInput
from gateway_harness import Harness, running_gateway, wait_until

from common.config.cache import CacheConfig
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(90)

PCM = "pcm_24000"
CACHED = "Hello world."
"""Spoken first, by itself: cached from then on."""


def _cache(**kw: Any) -> dict[str, Any]:
    return {"cache": CacheConfig(admit_after=1, **kw)}


async def _stored(h: Harness, n: int) -> None:
    name = "orpheus_gateway_cache_stores_total"
    await wait_until(lambda: h.metric(name) >= n, what=f"{n} cache stores")


async def _drained(r: Any) -> str | None:
    """The answer's ``X-Cache``, once its body is read (every unit's synthesis stored)."""
    assert [x async for x in r.data]
    return r.headers.get("x-cache")


def _turns(*texts: str) -> list[DialogueInput]:
    return [DialogueInput(text=t, voice_id=v) for t, v in zip(texts, ["tara", "leo"], strict=False)]


async def test_text_to_speech_routes_say_x_cache(layout: InstanceLayout) -> None:
    async with running_gateway(layout, serve=_cache(), api_keys=["k"]) as h:
        tts = AsyncElevenLabs(base_url=h.url, api_key="k").text_to_speech.with_raw_response
        async with tts.convert("tara", text=CACHED, output_format=PCM) as r:
            assert await _drained(r) == "miss"
        await _stored(h, 1)
        async with tts.convert("tara", text=CACHED, output_format=PCM) as r:
            assert await _drained(r) == "hit"
        # Whole: every sentence; the first from the cache, the second synthesised.
        whole = await tts.convert_with_timestamps("tara", text=CACHED + " Bye now.")
        assert whole.headers["x-cache"] == "partial"
        await _stored(h, 2)
        whole = await tts.convert_with_timestamps("tara", text=CACHED + " Bye now.")
        assert whole.headers["x-cache"] == "hit"
        # Streamed: the first sentence's, whatever the later ones turn out to be.
        text = CACHED + " Something new."
        async with tts.stream("tara", text=text, output_format=PCM) as r:
            assert await _drained(r) == "hit"
        async with tts.stream_with_timestamps("tara", text="Never said. " + CACHED) as r:
            assert await _drained(r) == "miss"


async def test_text_to_dialogue_routes_say_x_cache(layout: InstanceLayout) -> None:
    async with running_gateway(layout, serve=_cache(), api_keys=["k"]) as h:
        el = AsyncElevenLabs(base_url=h.url, api_key="k")
        dialogue = el.text_to_dialogue.with_raw_response
        async with el.text_to_speech.with_raw_response.stream("tara", text=CACHED) as r:
            assert await _drained(r) == "miss"
        await _stored(h, 1)
        turns = _turns(CACHED, "A new turn.")
        async with dialogue.convert(inputs=turns, output_format=PCM) as r:  # streamed
            assert await _drained(r) == "hit"
        async with dialogue.stream(inputs=_turns("First words.", CACHED), output_format=PCM) as r:
            assert await _drained(r) == "miss"
        async with dialogue.stream_with_timestamps(inputs=turns, output_format=PCM) as r:
            assert await _drained(r) == "hit"
        # Whole: every sentence of every turn.
        fresh = _turns(CACHED, "Another new turn.")
        whole = await dialogue.convert_with_timestamps(inputs=fresh, output_format=PCM)
        assert whole.headers["x-cache"] == "partial"


async def test_no_x_cache_with_the_cache_off(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, serve=_cache(enabled=False), api_keys=["k"]) as h,
        aiohttp.ClientSession(headers={"xi-api-key": "k"}) as s,
    ):
        for path, body in [
            ("/v1/text-to-speech/tara", {"text": CACHED}),
            ("/v1/text-to-speech/tara/stream", {"text": CACHED}),
            ("/v1/text-to-dialogue", {"inputs": [{"text": CACHED, "voice_id": "tara"}]}),
        ]:
            for _ in range(2):
                async with s.post(h.url + path + "?output_format=" + PCM, json=body) as r:
                    assert r.status == 200 and await r.read()
                    assert "X-Cache" not in r.headers
