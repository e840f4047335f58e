"""A request's language through a running gateway (synthetic backend, whose ``submitted()``
is the text the model was given): normalised in that language on each front end, split at
its sentence ends, its dictionaries applied only in their language, a bad code refused."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from elevenlabs import AsyncElevenLabs
from elevenlabs.core.api_error import ApiError
from gateway_harness import Harness, running_gateway
from openai import AsyncOpenAI

from codec_worker.encoder import EncodeServer, VoiceEncoder
from codec_worker.snac_model import SNAC_24KHZ_SMALL, fuse_weight_norm
from common.config.llm import LLMConfig
from common.config.text import TextConfig
from orpheus_client.zmq_client import AsyncClient, SpeechError
from shm.layout import InstanceLayout
from store.lora import LoraEntry, LoraRegistry
from store.voices import VoicesConfig
from testkit.clips import wav_bytes
from testkit.tiny_model import random_snac

pytestmark = pytest.mark.timeout(90)

FRENCH_PLS = """<?xml version="1.0" encoding="UTF-8"?>
<lexicon version="1.0" xmlns="http://www.w3.org/2005/01/pronunciation-lexicon"
         alphabet="ipa" xml:lang="fr-FR">
  <lexeme><grapheme>SNCF</grapheme><alias>ess enne cé effe</alias></lexeme>
</lexicon>
""".encode()


def serve(state: Path, **llm: Any) -> dict[str, Any]:
    return {
        "voices": VoicesConfig(state_dir=str(state)),
        "text": TextConfig(normalization="on"),
        "llm": msgspec.structs.replace(LLMConfig(), **llm),
    }


def spoken(h: Harness) -> list[str]:
    return [s.text for s in h.backend.submitted()]


async def test_a_french_request_reaches_the_model_in_french_on_elevenlabs_and_openai(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, serve=serve(tmp_path)) as h:
        el = AsyncElevenLabs(base_url=h.url, api_key="k")
        audio = [
            c
            async for c in el.text_to_speech.stream(
                "tara", text="Il a 21 ans.", language_code="fr", output_format="pcm_24000"
            )
        ]
        assert b"".join(audio)
        assert spoken(h)[-1] == "Il a vingt et un ans."

        oa = AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k")
        async with oa.audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input="Le 1er mai, 12,50 €.",
            response_format="pcm", extra_body={"language": "fr"},
        ) as r:  # fmt: skip
            assert await r.read()
        assert spoken(h)[-1] == "Le premier mai, douze euros et cinquante centimes."

        # No language: the server's default, English.
        async with oa.audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input="He is 21.", response_format="pcm"
        ) as r:
            await r.read()
        assert spoken(h)[-1] == "He is twenty-one."

        # An unknown code: a 400 naming the field, nothing spoken.
        before = len(spoken(h))
        with pytest.raises(ApiError) as e:
            async for _ in el.text_to_speech.stream("tara", text="x", language_code="xx"):
                pass
        assert e.value.status_code == 400
        async with aiohttp.ClientSession() as s:
            body = {"model": "orpheus", "voice": "tara", "input": "x", "language": "klingon"}
            async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == "language"
                assert "unknown language 'klingon'" in err["message"]
        assert len(spoken(h)) == before


async def test_mandarin_is_split_at_its_sentence_ends_and_spoken_in_mandarin(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, serve=serve(tmp_path)) as h:
        el = AsyncElevenLabs(base_url=h.url, api_key="k")
        text = "今天是2024年3月5日。我们有21个人！你来吗？好的"
        [c async for c in el.text_to_speech.stream("tara", text=text, language_code="zh")]
        assert spoken(h)[-4:] == [
            "今天是二零二四年三月五日。",
            "我们有二十一个人！",
            "你来吗？",
            "好的",
        ]


async def test_other_front_ends_take_the_language_field(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, serve=serve(tmp_path), zmq=True) as h:
        async with aiohttp.ClientSession() as s:
            # ElevenLabs' WebSocket: language_code in the query.
            url = f"{h.url}/v1/text-to-speech/tara/stream-input?language_code=de"
            async with s.ws_connect(url) as ws:
                await ws.send_json({"text": " "})
                await ws.send_json({"text": "Es kostet 3,5 €. ", "flush": True})
                await ws.send_json({"text": ""})
                async for m in ws:
                    if json.loads(m.data).get("isFinal"):
                        break
            assert spoken(h)[-1] == "Es kostet drei Euro und fünfzig Cent."
            # Baseten's predict; vLLM-Omni's English names.
            body = {"prompt": "Son las 14:05.", "voice": "tara", "language": "es"}
            async with s.post(f"{h.url}/v1/baseten/orpheus/predict", json=body) as r:
                assert r.status == 200
                await r.read()
            assert spoken(h)[-1] == "Son las catorce y cinco."
            async with s.ws_connect(f"{h.url}/v1/audio/speech/stream") as ws:
                await ws.send_json(
                    {"type": "session.config", "voice": "tara", "language": "Italian",
                     "response_format": "pcm"}
                )  # fmt: skip
                await ws.send_json({"type": "input.text", "text": "Siamo in 21."})
                await ws.send_json({"type": "input.done"})
                async for m in ws:
                    if m.type == aiohttp.WSMsgType.TEXT and '"session.done"' in m.data:
                        break
            assert spoken(h)[-1] == "Siamo in ventuno."
            # An unknown code on a socket: the protocol's error message, naming it.
            async with s.ws_connect(f"{h.url}/v1/audio/speech/stream") as ws:
                await ws.send_json({"type": "session.config", "language": "Klingon"})
                err = await ws.receive_json(timeout=10)
                assert err["type"] == "error" and err["code"] == "invalid_language"
                assert "unknown language 'Klingon'" in err["message"]
        # ZeroMQ: the wire's ``language``.
        async with AsyncClient(h.config.gateway.zmq_endpoint) as zc:
            assert b"".join(
                [c async for c in zc.speech("Es sind 21.", voice="tara", language="de")]
            )
        assert spoken(h)[-1] == "Es sind einundzwanzig."
        async with AsyncClient(h.config.gateway.zmq_endpoint) as zc:
            with pytest.raises(SpeechError) as e:
                async for _ in zc.speech("x", voice="tara", language="xx-YY"):
                    pass
        assert (e.value.status, e.value.code) == (400, "invalid_language")


async def test_a_voice_and_a_checkpoint_carry_their_language(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    cfg = serve(
        tmp_path,
        voices=["pierre", "jana"],
        default_voice="pierre",
        languages=["fr"],
        voice_languages={"jana": "de"},
    )
    backend = {"voices": ["pierre", "jana"]}
    async with running_gateway(layout, serve=cfg, backend=backend) as h:
        async with aiohttp.ClientSession() as s:
            for voice, want in (("pierre", "vingt et un."), ("jana", "einundzwanzig.")):
                body = {
                    "model": "orpheus",
                    "voice": voice,
                    "input": "21.",
                    "response_format": "pcm",
                }
                async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                assert spoken(h)[-1] == want
            # The request's own language wins over the voice's.
            body = {"model": "orpheus", "voice": "jana", "input": "21.", "language": "en"}
            async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                await r.read()
            assert spoken(h)[-1] == "twenty-one."


async def test_a_dictionary_applies_only_to_requests_in_its_language(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, serve=serve(tmp_path)) as h:
        el = AsyncElevenLabs(base_url=h.url, api_key="k")
        d = await el.pronunciation_dictionaries.create_from_file(
            name="fr", file=("fr.pls", io.BytesIO(FRENCH_PLS))
        )
        loc = {"pronunciation_dictionary_id": d.id}
        async with aiohttp.ClientSession() as s:
            for language, want in (("fr", "La ess enne cé effe."), ("en", "La SNCF.")):
                path = "/v1/text-to-speech/tara/stream?output_format=pcm_24000"
                body = {
                    "text": "La SNCF.", "language_code": language,
                    "pronunciation_dictionary_locators": [loc],
                }  # fmt: skip
                async with s.post(f"{h.url}{path}", json=body) as r:
                    assert r.status == 200
                    await r.read()
                assert spoken(h)[-1] == want
            # Downloaded, it keeps its language.
            async with s.get(
                f"{h.url}/v1/pronunciation-dictionaries/{d.id}/{d.version_id}/download"
            ) as r:
                assert b'xml:lang="fr"' in await r.read()


async def test_a_custom_voice_made_with_a_language_speaks_it(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    snac = fuse_weight_norm(random_snac(5, SNAC_24KHZ_SMALL))
    srv = EncodeServer(VoiceEncoder(snac), layout.encode)
    srv.start()
    t = np.arange(int(3.5 * 24_000)) / 24_000
    clip = wav_bytes((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)[:, None], 24_000)
    cfg = serve(tmp_path, voices=["tara"], zero_shot=True)
    try:
        async with (
            running_gateway(layout, serve=cfg, backend={"voices": ["tara", "amelie"]}) as h,
            aiohttp.ClientSession() as s,
        ):
            for language, status in (("klingon", 400), ("fr-FR", 201)):
                form = aiohttp.FormData(default_to_multipart=True)
                for k, v in (
                    ("name", "Amelie"),
                    ("transcript", "Bonjour."),
                    ("language", language),
                ):
                    form.add_field(k, v)
                form.add_field("audio", clip, filename="clip.wav", content_type="audio/wav")
                async with s.post(f"{h.url}/v1/audio/voices", data=form) as r:
                    body = await r.json()
                    assert r.status == status, body
            assert body["language"] == "fr"
            async with s.get(f"{h.url}/v1/audio/voices") as r:
                assert (await r.json())["custom"][0]["language"] == "fr"
            payload = {"model": "orpheus", "voice": "amelie", "input": "Il a 21 ans."}
            async with s.post(f"{h.url}/v1/audio/speech", json=payload) as r:
                assert r.status == 200, await r.text()
                await r.read()
            assert spoken(h)[-1] == "Il a vingt et un ans."
    finally:
        srv.stop()


async def test_a_lora_voice_loaded_at_run_time_keeps_its_language(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """The entry the llm worker writes when ``POST /v1/admin/lora`` loaded the adapter
    (``llm_worker.voices.lora``), with the language the call named."""
    cfg = serve(tmp_path, enable_lora=True)
    async with running_gateway(layout, serve=cfg, backend={"voices": ["tara", "ben"]}) as h:
        registry = LoraRegistry(tmp_path)
        registry.save(LoraEntry(name="ben", path="/adapters/ben", language="de"))
        async with aiohttp.ClientSession() as s:
            for want in ("einundzwanzig.", "zwei."):
                body = {
                    "model": "orpheus",
                    "voice": "ben",
                    "input": "21." if "ein" in want else "2.",
                }
                async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                assert spoken(h)[-1] == want
            registry.save(LoraEntry(name="ben", path="/adapters/ben", language="fr"))
            async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                await r.read()
            assert spoken(h)[-1] == "deux."
