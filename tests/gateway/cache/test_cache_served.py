"""The sentence audio cache in the gateway, over the synthetic backend: a repeat is served
from the cache (``X-Cache: hit``, no worker stream, the stored bytes), never across API keys,
never under ``Cache-Control: no-store``; ``no-cache`` synthesises again and stores; a
streaming protocol's sentences hit one by one; a hit holds no engine slot but counts in its
key's concurrency; a cache whose directory is gone fails no request."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from elevenlabs_ws import ws_path
from gateway_harness import Harness, running_gateway, wait_until

from common.config.cache import CacheConfig
from gateway.admission.queue import Admission, KeyLimits
from gateway.errors import APIError
from orpheus_wire.zeromq import Audio, Done, Started, server_decoder
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)

TEXT = "Thank you for calling, how can I help you today?"


def _cache(tmp_path: Path, **kw: object) -> dict[str, object]:
    return {"cache": CacheConfig(enabled=True, dir=str(tmp_path / "cache"), **kw)}


async def _speak(
    h: Harness,
    s: aiohttp.ClientSession,
    key: str,
    text: str = TEXT,
    cache_control: str | None = None,
) -> tuple[str | None, bytes]:
    headers = {"Authorization": f"Bearer {key}"}
    if cache_control is not None:
        headers["Cache-Control"] = cache_control
    body = {"model": "tts-1", "input": text, "voice": "tara", "response_format": "pcm"}
    async with s.post(h.url + "/v1/audio/speech", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return r.headers.get("X-Cache"), await r.read()


def _stores(h: Harness) -> float:
    return h.metric("orpheus_gateway_cache_stores_total")


async def _stored(h: Harness, n: int) -> None:
    await wait_until(lambda: _stores(h) >= n, what=f"{n} cache stores")


async def test_a_repeat_is_served_from_the_cache_byte_identical(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(layout, serve=_cache(tmp_path), api_keys=["k1", "k2"]) as h,
        aiohttp.ClientSession() as s,
    ):
        assert (await _speak(h, s, "k1"))[0] == "miss"
        state, first = await _speak(h, s, "k1")
        assert state == "miss"
        await _stored(h, 1)  # the second synthesis stored it (admitted on second sight)
        submits = len(h.backend.submitted())
        state, audio = await _speak(h, s, "k1")
        assert state == "hit" and audio == first and len(audio) > 0
        assert len(h.backend.submitted()) == submits  # no worker stream for a hit
        assert h.metric("orpheus_gateway_cache_lookups_total", {"result": "hit"}) == 1
        assert h.gateway.admission.by_engine == [0] and not h.gateway.admission.by_key
        # Another key says the same: a miss (its own entries), synthesised.
        state, _ = await _speak(h, s, "k2")
        assert state == "miss" and len(h.backend.submitted()) == submits + 1
        # A format other than the stored PCM is encoded from the same entry.
        body = {"model": "tts-1", "input": TEXT, "voice": "tara", "response_format": "wav"}
        async with s.post(
            h.url + "/v1/audio/speech", json=body, headers={"Authorization": "Bearer k1"}
        ) as r:
            assert r.headers["X-Cache"] == "hit" and (await r.read()).startswith(b"RIFF")
        # A text with a pause is not one unit: never cached.
        state, _ = await _speak(h, s, "k1", 'Hello. <break time="0.2s"/> Goodbye.')
        assert state is None


async def test_no_store_neither_reads_nor_writes_and_no_cache_regenerates(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(layout, serve=_cache(tmp_path), api_keys=["k1"]) as h,
        aiohttp.ClientSession() as s,
    ):
        for _ in range(3):
            assert (await _speak(h, s, "k1", cache_control="no-store"))[0] == "miss"
        await asyncio.sleep(0.2)
        assert _stores(h) == 0 and not list((tmp_path / "cache").glob("*/*"))
        await _speak(h, s, "k1")
        await _speak(h, s, "k1")
        await _stored(h, 1)
        assert (await _speak(h, s, "k1", cache_control="no-store"))[0] == "miss"
        submits = len(h.backend.submitted())
        assert (await _speak(h, s, "k1", cache_control="no-cache"))[0] == "miss"
        assert len(h.backend.submitted()) == submits + 1  # synthesised again
        await _stored(h, 2)  # and stored again
        assert (await _speak(h, s, "k1"))[0] == "hit"
        assert h.metric("orpheus_gateway_cache_lookups_total", {"result": "bypass"}) == 5


async def test_a_text_whose_first_sentence_is_cached_is_a_partial_hit(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """The cached greeting plays first and only the rest reaches the workers, submitted
    with the request; a text all of whose sentences are cached is a hit."""
    greeting, rest = "Hello, thanks for calling.", "Your order ships on Monday."
    async with (
        running_gateway(layout, serve=_cache(tmp_path), api_keys=["k1"]) as h,
        aiohttp.ClientSession() as s,
    ):
        await _speak(h, s, "k1", greeting)
        _, greeting_pcm = await _speak(h, s, "k1", greeting)
        await _stored(h, 1)
        submits = len(h.backend.submitted())
        state, audio = await _speak(h, s, "k1", f"{greeting}  {rest}")
        assert state == "partial"
        assert [m.text for m in h.backend.submitted()[submits:]] == [rest]
        assert audio.startswith(greeting_pcm) and len(audio) > len(greeting_pcm)
        assert h.metric("orpheus_gateway_cache_lookups_total", {"result": "partial"}) == 1
        _, rest_pcm = await _speak(h, s, "k1", rest)  # the rest's second synthesis: stored
        await _stored(h, 2)
        submits = len(h.backend.submitted())
        state, both = await _speak(h, s, "k1", f"{greeting} {rest}")
        assert state == "hit" and both == greeting_pcm + rest_pcm
        assert len(h.backend.submitted()) == submits


async def test_node_scope_shares_entries_between_keys(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(layout, serve=_cache(tmp_path, scope="node"), api_keys=["k1", "k2"]) as h,
        aiohttp.ClientSession() as s,
    ):
        await _speak(h, s, "k1")
        await _speak(h, s, "k2")
        await _stored(h, 1)
        assert (await _speak(h, s, "k2"))[0] == "hit"
        assert (await _speak(h, s, "k1"))[0] == "hit"


async def _omni_say(
    h: Harness, s: aiohttp.ClientSession, text: str, granularity: str = "none"
) -> tuple[int, list[object]]:
    """vLLM-Omni's WebSocket, one utterance: its audio bytes and each shown unit's
    ``audio.done`` ``cache`` (None: absent)."""
    async with s.ws_connect(h.url + "/v1/audio/speech/stream") as ws:
        config = {"type": "session.config", "voice": "tara", "split_granularity": granularity}
        await ws.send_json(config)
        await ws.send_json({"type": "input.text", "text": text})
        await ws.send_json({"type": "input.done"})
        audio, states = 0, []
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                audio += len(msg.data)
            elif msg.type == aiohttp.WSMsgType.TEXT:
                event = json.loads(msg.data)
                if event["type"] == "audio.done":
                    states.append(event.get("cache"))
                elif event["type"] == "session.done":
                    break
        return audio, states


async def test_a_streaming_protocol_s_sentences_hit_one_by_one(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """vLLM-Omni's WebSocket: each sentence is a unit; a known one streams from the cache,
    the new one behind it is synthesised; ``audio.done`` says which: per sentence when the
    client asks for sentences, and of the whole utterance (``partial``) when not."""
    greeting, new = "Hello, thanks for calling.", "Your order ships on Monday."
    async with (
        running_gateway(layout, serve=_cache(tmp_path)) as h,
        aiohttp.ClientSession() as s,
    ):
        assert (await _omni_say(h, s, greeting))[1] == ["miss"]
        assert (await _omni_say(h, s, greeting))[1] == ["miss"]
        await _stored(h, 1)
        submits = len(h.backend.submitted())
        audio, states = await _omni_say(h, s, f"{greeting} {new}")
        assert audio > 0 and states == ["partial"]  # one shown unit: the utterance
        sent = [m.text for m in h.backend.submitted()[submits:]]
        assert sent == [new]  # the greeting came from the cache
        states = (await _omni_say(h, s, f"{greeting} {new}", "sentence"))[1]
        assert states == ["hit", "miss"]


async def _elevenlabs_turns(
    h: Harness, path: str, turns: list[str], single: bool = False
) -> list[dict[str, object]]:
    """ElevenLabs' WebSocket (multi-context, or the single-context ``stream-input``): each
    turn's final message (one context a turn; the single socket: one socket a turn)."""
    finals = []
    async with aiohttp.ClientSession() as s:
        for i, text in enumerate(turns):
            async with s.ws_connect(h.url + path) as ws:
                if single:
                    for m in ({"text": " "}, {"text": text}, {"text": ""}):
                        await ws.send_json(m)
                else:
                    cid = f"turn{i}"
                    await ws.send_json({"text": text, "context_id": cid, "flush": True})
                    await ws.send_json({"text": "", "context_id": cid, "flush": True})
                    await ws.send_json({"context_id": cid, "close_context": True})
                async for msg in ws:
                    assert msg.type == aiohttp.WSMsgType.TEXT, msg
                    m = json.loads(msg.data)
                    assert "error" not in m, m
                    if m.get("isFinal"):
                        finals.append(m)
                        break
    return finals


@pytest.mark.parametrize("single", [False, True], ids=["multi-context", "single-context"])
async def test_elevenlabs_s_final_message_says_the_cache_state_of_its_context(
    layout: InstanceLayout, tmp_path: Path, single: bool
) -> None:
    """``isFinal``'s message carries ``cache``: ``miss`` for a context synthesised, ``hit``
    for one all of whose sentences came from the cache, ``partial`` for a cached greeting
    with new content behind it. ElevenLabs' SDK (its pydantic models allow extra fields),
    Pipecat and LiveKit read the message as before (tests/gateway/test_voice_agent_clients)."""
    from elevenlabs.types import FinalOutput, FinalOutputMulti

    greeting, new = "Hello, thanks for calling.", "Your order ships on Monday."
    path = (
        "/v1/text-to-speech/tara/stream-input?output_format=pcm_24000"
        if single
        else ws_path("tara")
    )
    async with running_gateway(layout, serve=_cache(tmp_path, admit_after=1)) as h:
        finals = await _elevenlabs_turns(h, path, [greeting], single)
        await _stored(h, 1)
        finals += await _elevenlabs_turns(h, path, [greeting, f"{greeting} {new}"], single)
    assert [f["cache"] for f in finals] == ["miss", "hit", "partial"]
    for f in finals:
        parsed = (FinalOutput if single else FinalOutputMulti).model_validate(f)
        assert parsed.is_final is True
        assert single or parsed.context_id == f["contextId"]


async def test_with_the_cache_off_the_socket_s_final_messages_are_as_before(
    layout: InstanceLayout,
) -> None:
    off = {"cache": CacheConfig(enabled=False)}
    async with running_gateway(layout, serve=off) as h, aiohttp.ClientSession() as s:
        (final,) = await _elevenlabs_turns(h, ws_path("tara"), ["Hello there."])
        assert final == {"contextId": "turn0", "isFinal": True}
        assert (await _omni_say(h, s, "Hello there."))[1] == [None]


async def test_a_cache_whose_directory_went_away_fails_no_request(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(layout, serve=_cache(tmp_path, admit_after=1), api_keys=["k1"]) as h,
        aiohttp.ClientSession() as s,
    ):
        await _speak(h, s, "k1")
        await _stored(h, 1)
        shutil.rmtree(tmp_path / "cache")
        (tmp_path / "cache").write_text("not a directory")  # every read and write fails
        for _ in range(3):
            state, audio = await _speak(h, s, "k1")
            assert state == "miss" and audio
        await wait_until(lambda: h.metric("orpheus_gateway_cache_errors_total") >= 3)


async def test_a_hit_counts_in_its_key_s_concurrency_and_takes_no_engine_slot() -> None:
    admission = Admission(4, 4, 1.0, 1, lambda: None, key_limits=KeyLimits(1))
    admission.hold_key("k1")
    assert admission.by_engine == [0] and admission.slotless_by_key == {"k1": 1}
    assert not admission.by_key  # what the key's fair share counts
    with pytest.raises(APIError) as e:
        await admission.acquire("k1")
    assert e.value.status == 429
    with pytest.raises(APIError):
        admission.hold_key("k1")
    assert await admission.acquire("k2") == 0  # other keys: the engine slot is free
    admission.release_key("k1")
    assert admission.by_key == {"k2": 1} and not admission.slotless_by_key
    assert await admission.acquire("k1") == 0


async def test_elevenlabs_zero_retention_never_stores_and_its_sentences_hit(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """ElevenLabs' ``enable_logging=false`` stores nothing; its units are cached like any
    protocol's otherwise (sentence by sentence)."""
    body = {"text": "Hello world. Bye now.", "model_id": "eleven_turbo_v2_5"}
    url = "/v1/text-to-speech/tara/stream?output_format=pcm_24000"
    async with (
        running_gateway(layout, serve=_cache(tmp_path), api_keys=["k"]) as h,
        aiohttp.ClientSession() as s,
    ):
        hdr = {"xi-api-key": "k"}
        for _ in range(3):
            async with s.post(h.url + url + "&enable_logging=false", json=body, headers=hdr) as r:
                assert r.status == 200 and await r.read()
        await asyncio.sleep(0.2)
        assert _stores(h) == 0 and not list((tmp_path / "cache").glob("*/*.pcm"))
        for _ in range(2):
            async with s.post(h.url + url, json=body, headers=hdr) as r:
                first = await r.read()
        await _stored(h, 2)  # both sentences
        submits = len(h.backend.submitted())
        async with s.post(h.url + url, json=body, headers=hdr) as r:
            assert await r.read() == first
        assert len(h.backend.submitted()) == submits


async def test_zeromq_says_hit_in_done_and_takes_the_cache_field(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, zmq=True, serve=_cache(tmp_path)) as h:
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(h.config.gateway.zmq_endpoint or "")
        try:

            async def speak(rid: int, **fields: object) -> tuple[Done, bytes]:
                msg = {"type": "speak", "request_id": rid, "input": TEXT, "voice": "tara"}
                await sock.send(msgspec.msgpack.encode({**msg, **fields}))
                audio = b""
                while True:
                    assert await sock.poll(10_000)
                    reply = server_decoder.decode(await sock.recv())
                    if isinstance(reply, Audio):
                        audio += reply.data
                    elif isinstance(reply, Done):
                        return reply, audio
                    else:
                        assert isinstance(reply, Started), reply

            assert (await speak(1, cache="no-store"))[0].cache == "miss"
            assert (await speak(2, cache="no-store"))[0].cache == "miss"
            await asyncio.sleep(0.2)
            assert _stores(h) == 0
            await speak(3)
            done, audio = await speak(4)
            assert done.cache == "miss"
            await _stored(h, 1)
            done, hit = await speak(5)
            assert done.cache == "hit" and hit == audio
            assert (await speak(6, cache="no-cache"))[0].cache == "miss"
        finally:
            sock.close(linger=0)


async def test_a_key_purges_its_own_entries_and_an_admin_the_node_s(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(
            layout,
            serve=_cache(tmp_path, admit_after=1),
            api_keys=["k1", "k2"],
            admin_keys=["adm"],
        ) as h,
        aiohttp.ClientSession() as s,
    ):
        await _speak(h, s, "k1")
        await _speak(h, s, "k2")
        await _stored(h, 2)

        async def purge(path: str, key: str) -> tuple[int, dict[str, object]]:
            headers = {"Authorization": f"Bearer {key}"}
            async with s.delete(h.url + path, headers=headers) as r:
                return r.status, await r.json()

        assert await purge("/v1/cache", "k1") == (200, {"purged": 1})
        assert (await _speak(h, s, "k1"))[0] == "miss"  # gone (and stored again: admit_after 1)
        assert (await _speak(h, s, "k2"))[0] == "hit"  # k2's stayed
        assert (await purge("/v1/admin/cache", "k1"))[0] == 401
        await _stored(h, 3)
        assert await purge("/v1/admin/cache", "adm") == (200, {"purged": 2})
        assert (await _speak(h, s, "k2"))[0] == "miss"


async def test_a_shared_cache_is_purged_by_an_admin_only(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(layout, serve=_cache(tmp_path, scope="node"), api_keys=["k1"]) as h,
        aiohttp.ClientSession() as s,
        s.delete(h.url + "/v1/cache", headers={"Authorization": "Bearer k1"}) as r,
    ):
        assert r.status == 409 and (await r.json())["error"]["code"] == "cache_shared"


async def test_a_websocket_upgrade_s_no_store_holds_for_all_its_units(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(layout, serve=_cache(tmp_path, admit_after=1)) as h,
        aiohttp.ClientSession() as s,
    ):
        for _ in range(2):
            async with s.ws_connect(
                h.url + "/v1/audio/speech/stream", headers={"Cache-Control": "no-store"}
            ) as ws:
                await ws.send_json({"type": "session.config", "voice": "tara"})
                await ws.send_json({"type": "input.text", "text": "One. Two."})
                await ws.send_json({"type": "input.done"})
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.TEXT and '"session.done"' in msg.data:
                        break
        assert len(h.backend.submitted()) == 4  # every unit synthesised, each time
        assert _stores(h) == 0
        assert h.metric("orpheus_gateway_cache_lookups_total", {"result": "bypass"}) == 4


SHORT = "Hello there, friend."
"""20 characters: 20 frames of the synthetic backend, 1.7 s at its real-time pace."""


async def test_concurrent_twins_synthesise_once(layout: InstanceLayout, tmp_path: Path) -> None:
    """Single flight: five twins that ask while the first is synthesised follow it (its
    audio so far at once, the rest as it is made): one worker stream for six answers."""
    async with (
        running_gateway(
            layout, backend={"realtime": True}, serve=_cache(tmp_path), api_keys=["k1"]
        ) as h,
        aiohttp.ClientSession() as s,
    ):
        first = asyncio.create_task(_speak(h, s, "k1", SHORT))
        await wait_until(lambda: len(h.backend.submitted()) == 1, what="the first submit")
        twins = await asyncio.gather(*(_speak(h, s, "k1", SHORT) for _ in range(5)))
        state, audio = await first
        assert state == "miss" and len(audio) == len(SHORT) * 2048 * 2
        assert twins == [("hit", audio)] * 5
        assert len(h.backend.submitted()) == 1
        assert h.metric("orpheus_gateway_cache_lookups_total", {"result": "join"}) == 5
        assert h.gateway.admission.by_engine == [0] and not h.gateway.admission.by_key


async def test_a_leader_whose_client_left_goes_on_for_its_followers(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(
            layout,
            backend={"realtime": True},
            serve=_cache(tmp_path, admit_after=1),
            api_keys=["k1"],
        ) as h,
        aiohttp.ClientSession() as s,
        aiohttp.ClientSession() as leaver,
    ):
        body = {"model": "tts-1", "input": SHORT, "voice": "tara", "response_format": "pcm"}
        resp = await leaver.post(
            h.url + "/v1/audio/speech", json=body, headers={"Authorization": "Bearer k1"}
        )
        await resp.content.readany()  # its first audio
        follower = asyncio.create_task(_speak(h, s, "k1", SHORT))
        await wait_until(
            lambda: h.metric("orpheus_gateway_cache_lookups_total", {"result": "join"}) == 1,
            what="the follower joined",
        )
        resp.close()  # the leader's client goes away mid-stream
        state, audio = await follower
        assert state == "hit" and len(audio) == len(SHORT) * 2048 * 2  # all of it
        assert not h.backend.cancelled_ids()  # its worker stream was not cancelled
        await _stored(h, 1)  # and, whole, it was stored
        await wait_until(lambda: h.gateway.admission.by_engine == [0], what="the slot freed")
        assert (await _speak(h, s, "k1", SHORT)) == ("hit", audio)


async def test_warming_fills_the_cache_so_the_first_call_hits(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """``POST /v1/cache/warm``: each phrase's sentences stored at once (no second sight),
    already cached ones skipped; the first request of a warmed phrase is a hit."""
    async with (
        running_gateway(layout, serve=_cache(tmp_path), api_keys=["k1", "k2"]) as h,
        aiohttp.ClientSession() as s,
    ):
        body = {"input": [TEXT, "Please hold. We will be right with you."], "voice": "tara"}
        headers = {"Authorization": "Bearer k1"}
        async with s.post(h.url + "/v1/cache/warm", json=body, headers=headers) as r:
            assert r.status == 202 and await r.json() == {"units": 3}
        await _stored(h, 3)
        submits = len(h.backend.submitted())
        assert (await _speak(h, s, "k1"))[0] == "hit"
        assert (await _speak(h, s, "k1", "Please hold. We will be right with you."))[0] == "hit"
        assert (await _speak(h, s, "k2"))[0] == "miss"  # warmed for k1 only
        async with s.post(h.url + "/v1/cache/warm", json=body, headers=headers) as r:
            assert r.status == 202
        await asyncio.sleep(0.3)
        assert len(h.backend.submitted()) == submits + 1  # the k2 miss; nothing re-warmed
        async with s.post(h.url + "/v1/cache/warm", json={"input": []}, headers=headers) as r:
            assert r.status == 400


async def test_warming_waits_for_room_beyond_the_interactive_reserve(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """With every slot inside the jobs' reserve (2 slots, a reserve of 8) nothing is warmed,
    while an interactive request is served."""
    async with (
        running_gateway(layout, serve=_cache(tmp_path), max_active_streams=2) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(h.url + "/v1/cache/warm", json={"input": ["Hello there."]}) as r:
            assert r.status == 202
        await asyncio.sleep(1.0)
        assert not h.backend.submitted() and _stores(h) == 0
        assert (await _speak(h, s, "", "Something else."))[0] == "miss"
        assert len(h.backend.submitted()) == 1
