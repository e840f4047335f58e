"""The official ``elevenlabs`` SDK's speech and voice calls, with its defaults, against the
gateway and its synthetic backend (one 2048-sample frame per character it is sent):
``text_to_speech.convert`` / ``convert_with_timestamps`` (whole audio), ``voices.get_all`` /
``search`` / ``get`` and ``models.list`` (the streaming calls: tests/gateway/text/test_dictionaries_served.py,
tests/gateway/frontends/test_voice_agent_clients.py)."""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path
from typing import Any

import aiohttp
import av
import numpy as np
import pytest
from elevenlabs import AsyncElevenLabs
from elevenlabs.core.api_error import ApiError
from elevenlabs.pronunciation_dictionaries import (
    BodyAddAPronunciationDictionaryV1PronunciationDictionariesAddFromRulesPostRulesItem_Alias as AliasIn,
)
from elevenlabs.types import PronunciationDictionaryVersionLocator as VersionLocator
from elevenlabs.types import VoiceSettings
from gateway_harness import Harness, running_gateway
from openai import AsyncOpenAI

from common.config.llm import LLMConfig, LoraVoice
from common.config.text import TextConfig
from shm.layout import InstanceLayout
from shm.messages import LlmSubmit
from shm.records import StreamError
from store.voices import VoicesConfig, VoiceStore, new_record
from testkit.synthetic_backend import StreamPlan, default_plan, synthetic_pcm

pytestmark = pytest.mark.timeout(90)

TEXT = "Hello world. Bye now."
"""Two units: "Hello world." (12 frames) and "Bye now." (8 frames)."""
SECONDS = 20 * 2048 / 24000


def pcm_for(frames: int) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(frames))


def client(h: Harness, key: str = "k") -> AsyncElevenLabs:
    return AsyncElevenLabs(base_url=h.url, api_key=key)


async def drain(it: Any) -> bytes:
    return b"".join([x async for x in it])


def failing_plan(submit: LlmSubmit) -> StreamPlan:
    """The synthetic backend's plan, except that a text with "Fail" fails after 2 chunks."""
    plan = default_plan(["tara", "leah"])(submit)
    if "Fail" in submit.text:
        err = StreamError("engine_error", "the engine failed", 500)
        return StreamPlan(frames=plan.frames, error=err, error_after=2)
    return plan


def decoded_seconds(data: bytes) -> float:
    with av.open(io.BytesIO(data)) as c:
        return sum(f.samples for f in c.decode(audio=0)) / c.streams.audio[0].rate


async def test_convert_s_defaults_and_a_whole_body_s_length(layout: InstanceLayout) -> None:
    """Every format the SDK declares: tests/gateway/frontends/elevenlabs/test_elevenlabs_formats.py."""
    async with running_gateway(layout, api_keys=["k"]) as h:
        el = client(h)
        # The SDK's defaults: mp3_44100_128, any model_id.
        default = await drain(el.text_to_speech.convert("tara", text=TEXT))
        assert SECONDS <= decoded_seconds(default) < SECONDS + 0.15
        async with aiohttp.ClientSession() as s:  # a whole body: its length is known
            url = h.url + "/v1/text-to-speech/tara?output_format=pcm_24000"
            async with s.post(url, json={"text": TEXT}, headers={"xi-api-key": "k"}) as r:
                assert r.status == 200 and r.content_type == "audio/pcm"
                assert r.content_length == 20 * 4096 and await r.read() == pcm_for(12) + pcm_for(8)


async def test_convert_with_timestamps_is_one_json(layout: InstanceLayout, tmp_path: Path) -> None:
    serve = {"voices": VoicesConfig(state_dir=str(tmp_path)), "text": TextConfig()}
    async with running_gateway(layout, serve=serve) as h:
        el = client(h)
        r = await el.text_to_speech.convert_with_timestamps(
            "tara", text=TEXT, output_format="pcm_24000"
        )
        assert base64.b64decode(r.audio_base_64) == pcm_for(12) + pcm_for(8)
        assert r.alignment is not None and r.normalized_alignment is not None
        assert "".join(r.alignment.characters) == TEXT
        ends = r.alignment.character_end_times_seconds
        starts = r.alignment.character_start_times_seconds
        assert len(starts) == len(ends) == len(TEXT)
        assert ends == sorted(ends) and ends[-1] == pytest.approx(SECONDS, abs=0.002)
        # The same times as the streamed lines, joined.
        lines = [
            x
            async for x in el.text_to_speech.stream_with_timestamps(
                "tara", text=TEXT, output_format="pcm_24000"
            )
        ]
        streamed = [
            t for x in lines if x.alignment for t in x.alignment.character_end_times_seconds
        ]
        assert streamed == ends
        # Normalisation: the alignment is of the text sent, the normalized one of the text
        # spoken.
        r = await el.text_to_speech.convert_with_timestamps(
            "tara", text="I have 3 cats.", output_format="pcm_24000",
            apply_text_normalization="on",
        )  # fmt: skip
        assert r.alignment is not None and r.normalized_alignment is not None
        assert "".join(r.alignment.characters) == "I have 3 cats."
        assert "".join(r.normalized_alignment.characters) == "I have three cats."
        assert h.backend.submitted()[-1].text == "I have three cats."
        assert r.normalized_alignment.character_end_times_seconds[-1] == pytest.approx(
            len("I have three cats.") * 2048 / 24000, abs=0.002
        )


async def test_convert_takes_the_streaming_routes_parameters(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    serve = {"voices": VoicesConfig(state_dir=str(tmp_path)), "text": TextConfig()}
    async with running_gateway(layout, serve=serve, api_keys=["k"]) as h:
        el = client(h)
        d = await el.pronunciation_dictionaries.create_from_rules(
            name="tech", rules=[AliasIn(string_to_replace="Kubernetes", alias="koo-ber-net-eez")]
        )
        loc = VersionLocator(pronunciation_dictionary_id=d.id)
        for convert in (el.text_to_speech.convert, el.text_to_speech.convert_with_timestamps):
            got = convert(
                "leah", text="Kubernetes at 3 pm.", output_format="pcm_24000", seed=42,
                pronunciation_dictionary_locators=[loc], optimize_streaming_latency=3,
                enable_logging=False, model_id="eleven_multilingual_v2", language_code="en",
                # Accepted and ignored (docs/api.md): ElevenLabs' conditioning and style.
                previous_text="Before.", next_text="After.", previous_request_ids=["a"],
                next_request_ids=["b"], use_pvc_as_ivc=True,
                apply_language_text_normalization=False,
                voice_settings=VoiceSettings(
                    stability=0.3, similarity_boost=0.8, style=0.2, use_speaker_boost=True
                ),
            )  # fmt: skip
            await drain(got) if convert == el.text_to_speech.convert else await got
            sub = h.backend.submitted()[-1]
            assert (sub.text, sub.voice) == ("koo-ber-net-eez at three pm.", "leah")
            assert sub.sampling.seed == 42
        # speed: time-stretched (atempo), whole.
        fast = await drain(
            el.text_to_speech.convert(
                "tara", text="Twenty characters ok.", output_format="pcm_24000",
                voice_settings=VoiceSettings(speed=1.2),
            )
        )  # fmt: skip
        assert abs(len(fast) / 48000 - 21 * 2048 / 24000 / 1.2) < 0.1


async def test_convert_errors_are_json_with_their_status(layout: InstanceLayout) -> None:
    async with running_gateway(
        layout, max_input_chars=100, backend={"plan": failing_plan}
    ) as h:  # fmt: skip
        el = client(h)
        cases: list[tuple[dict[str, Any], int, str]] = [
            ({"audio_effects": {"pan": 0.5}}, 400, "unsupported_field"),
            ({"text": "x" * 101}, 400, "input_too_long"),
            ({"text": " "}, 400, "empty_input"),
            ({"output_format": "flac_44100"}, 400, "invalid_output_format"),
            ({"voice_id": "nobody"}, 400, "bad_request"),
            # A failure in the second sentence, after the first was spoken: still a status.
            ({"text": "Fine first. Fail second."}, 500, "engine_error"),
        ]
        for kw, status, code in cases:
            kw = {"voice_id": "tara", "text": "Hi there.", **kw}
            for call in ("convert", "convert_with_timestamps"):
                with pytest.raises(ApiError) as e:
                    got = getattr(el.text_to_speech, call)(**kw)
                    await drain(got) if call == "convert" else await got
                assert e.value.status_code == status, (kw, call, e.value.body)
                assert e.value.body["error"]["code"] == code, (kw, call, e.value.body)
        assert h.gateway.active_streams == 0


def _custom_voice(state: Path) -> None:
    codes = np.arange(4 * 7, dtype=np.int16).reshape(4, 7)
    rec = new_record("anna", "Anna", "Hello.", "a calm voice", codes, 3.5)
    VoiceStore(state).create(rec, max_voices=10)


VOICE_SERVE_LLM = LLMConfig(
    voices=["tara", "leah", "jess", "leo", "dan"],
    zero_shot=True,
    lora_voices={"pirate": LoraVoice("/adapters/pirate")},
)


async def test_voices_get_all_search_and_get(layout: InstanceLayout, tmp_path: Path) -> None:
    _custom_voice(tmp_path)
    serve = {"voices": VoicesConfig(state_dir=str(tmp_path)), "llm": VOICE_SERVE_LLM}
    async with running_gateway(layout, serve=serve, api_keys=["k"]) as h:
        el = client(h)
        every = (await el.voices.get_all()).voices
        assert [(v.voice_id, v.category) for v in every] == [
            *((v, "premade") for v in ("tara", "leah", "jess", "leo", "dan")),
            ("anna", "cloned"),
            ("pirate", "professional"),
        ]
        anna = every[5]
        assert (anna.name, anna.description, anna.labels) == (
            "Anna",
            "a calm voice",
            {"language": "en"},
        )
        assert anna.created_at_unix and abs(anna.created_at_unix - time.time()) < 600
        assert all(v.labels == {"language": "en"} for v in every)
        assert [lang.language for lang in every[0].verified_languages or []] == ["en"]

        # search pages as the SDK pages: has_more and next_page_token, total_count.
        seen, token = [], None
        while True:
            page = await el.voices.search(
                page_size=3, next_page_token=token, include_total_count=True
            )
            assert page.total_count == 7 and len(page.voices) <= 3
            seen += [v.voice_id for v in page.voices]
            if not page.has_more:
                assert page.next_page_token is None
                break
            token = page.next_page_token
        assert seen == [v.voice_id for v in every]

        async def ids(**kw: Any) -> list[str]:
            return [v.voice_id for v in (await el.voices.search(**kw)).voices]

        assert await ids(search="LE") == ["leah", "leo"]  # name, case-insensitive
        assert await ids(search="calm") == ["anna"]  # description
        assert await ids(category="premade", page_size=2) == ["tara", "leah"]
        assert await ids(voice_type="personal") == ["anna", "pirate"]
        assert await ids(voice_type="default", sort="name") == [
            "dan",
            "jess",
            "leah",
            "leo",
            "tara",
        ]
        assert await ids(sort="name", sort_direction="desc", page_size=3) == [
            "tara",
            "pirate",
            "leo",
        ]
        assert await ids(language="en", voice_ids=["dan", "anna", "nobody"]) == ["dan", "anna"]
        assert await ids(language="fr") == []
        assert await ids(gender="female") == []  # no voice carries the label
        for bad in (
            {"page_size": 0},
            {"page_size": 101},
            {"sort": "age"},
            {"next_page_token": "x"},
        ):
            with pytest.raises(ApiError) as e:
                await el.voices.search(**bad)
            assert e.value.status_code == 400, bad

        got = await el.voices.get("anna")
        assert (got.voice_id, got.category, got.name) == ("anna", "cloned", "Anna")
        assert (await el.voices.get("Tara")).voice_id == "tara"
        assert (await el.voices.get("pirate")).category == "professional"
        with pytest.raises(ApiError) as e:
            await el.voices.get("nobody")
        assert (e.value.status_code, e.value.body["error"]["code"]) == (404, "voice_not_found")
        with pytest.raises(ApiError) as e:  # the key is checked as on every route
            await client(h, "wrong").voices.get_all()
        assert e.value.status_code == 401


async def test_models_list_for_elevenlabs_and_openai_clients(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["k"], max_input_chars=3000) as h:
        models = await client(h).models.list()
        assert len(models) == 1
        m = models[0]
        assert m.model_id == h.config.llm.model and m.can_do_text_to_speech
        assert [(lang.language_id, lang.name) for lang in m.languages or []] == [("en", "English")]
        assert m.maximum_text_length_per_request == 3000
        oa = AsyncOpenAI(base_url=h.url + "/v1", api_key="k")
        names = [x.id async for x in oa.models.list()]
        assert names[0] == h.config.llm.model and "tts-1" in names
