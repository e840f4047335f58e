"""Pronunciation dictionaries and text normalisation through the gateway, driven with the
official ``elevenlabs`` SDK (and raw WebSocket messages as Pipecat sends them) against the
gateway with its synthetic backend, whose ``submitted()`` shows the text the model was given."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from elevenlabs import AsyncElevenLabs
from elevenlabs.core.api_error import ApiError
from elevenlabs.pronunciation_dictionaries import (
    BodyAddAPronunciationDictionaryV1PronunciationDictionariesAddFromRulesPostRulesItem_Alias as AliasIn,
)
from elevenlabs.pronunciation_dictionaries import (
    BodyAddAPronunciationDictionaryV1PronunciationDictionariesAddFromRulesPostRulesItem_Phoneme as PhonemeIn,
)
from elevenlabs.pronunciation_dictionaries.rules import PronunciationDictionaryRule_Alias
from elevenlabs.types import DialogueInput
from elevenlabs.types import PronunciationDictionaryVersionLocator as VersionLocator
from gateway_harness import Harness, running_gateway

from common.config.text import TextConfig
from gateway.text.pls import parse_pls
from orpheus_client.zmq_client import AsyncClient
from shm.layout import InstanceLayout
from store.voices import VoicesConfig

pytestmark = pytest.mark.timeout(90)

K8S = AliasIn(string_to_replace="Kubernetes", alias="koo-ber-net-eez")

PLS = b"""<?xml version="1.0" encoding="UTF-8"?>
<lexicon version="1.0" xmlns="http://www.w3.org/2005/01/pronunciation-lexicon"
         alphabet="ipa" xml:lang="en-US">
  <lexeme><grapheme>nginx</grapheme><alias>engine x</alias></lexeme>
  <lexeme><grapheme>SQL</grapheme><grapheme>sql</grapheme><alias>sequel</alias></lexeme>
</lexicon>
"""

BILLION_LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
]>
<lexicon version="1.0" xmlns="http://www.w3.org/2005/01/pronunciation-lexicon">
  <lexeme><grapheme>x</grapheme><alias>&lol3;</alias></lexeme>
</lexicon>
"""


def text_serve(state: Path, **text: Any) -> dict[str, Any]:
    return {
        "voices": VoicesConfig(state_dir=str(state)),
        "text": TextConfig(**({"normalization": "off"} | text)),
    }


def client(h: Harness, key: str = "k") -> AsyncElevenLabs:
    return AsyncElevenLabs(base_url=h.url, api_key=key)


def spoken(h: Harness) -> list[str]:
    return [s.text for s in h.backend.submitted()]


async def drain(it: Any) -> list[Any]:
    return [x async for x in it]


async def test_dictionaries_with_the_sdk_and_locators_on_http(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, serve=text_serve(tmp_path)) as h:
        el = client(h)
        d = await el.pronunciation_dictionaries.create_from_rules(
            name="tech", rules=[K8S], description="infra words"
        )
        assert d.version_rules_num == 1 and d.name == "tech"
        got = await el.pronunciation_dictionaries.get(d.id)
        assert got.latest_version_id == d.version_id
        assert [r.string_to_replace for r in got.rules] == ["Kubernetes"]

        # Use it: the streaming HTTP with a locator of the latest version.
        loc = VersionLocator(pronunciation_dictionary_id=d.id)
        audio = await drain(
            el.text_to_speech.stream(
                "tara", text="Kubernetes runs here.", output_format="pcm_24000",
                pronunciation_dictionary_locators=[loc],
            )
        )  # fmt: skip
        assert b"".join(audio)
        assert spoken(h)[-1] == "koo-ber-net-eez runs here."

        # Each change is a new version; an old version stays usable by its id.
        v2 = await el.pronunciation_dictionaries.rules.add(
            d.id, rules=[PronunciationDictionaryRule_Alias(string_to_replace="k8s", alias="kates")]
        )
        assert v2.version_id != d.version_id and v2.version_rules_num == 2
        v3 = await el.pronunciation_dictionaries.rules.remove(d.id, rule_strings=["Kubernetes"])
        assert v3.version_rules_num == 1
        await drain(
            el.text_to_speech.stream(
                "tara", text="Kubernetes and k8s.", output_format="pcm_24000",
                pronunciation_dictionary_locators=[loc],
            )
        )  # fmt: skip
        assert spoken(h)[-1] == "Kubernetes and kates."
        old = VersionLocator(pronunciation_dictionary_id=d.id, version_id=d.version_id)
        await drain(
            el.text_to_speech.stream(
                "tara", text="Kubernetes and k8s.", output_format="pcm_24000",
                pronunciation_dictionary_locators=[old],
            )
        )  # fmt: skip
        assert spoken(h)[-1] == "koo-ber-net-eez and k8s."

        # Download a version as PLS.
        pls = b"".join(await drain(el.pronunciation_dictionaries.download(d.id, v2.version_id)))
        rules = parse_pls(pls, max_bytes=1 << 20, max_rules=10)
        assert {(r.string_to_replace, r.alias) for r in rules} == {
            ("Kubernetes", "koo-ber-net-eez"),
            ("k8s", "kates"),
        }

        # From a PLS file; then listed.
        f = await el.pronunciation_dictionaries.create_from_file(
            name="db", file=("lex.pls", PLS, "application/pls+xml")
        )
        assert f.version_rules_num == 3
        listed = await el.pronunciation_dictionaries.list()
        assert {x.id for x in listed.pronunciation_dictionaries} == {d.id, f.id}
        assert not listed.has_more

        # Two dictionaries, in order, on the OpenAI route too (the same field).
        async with aiohttp.ClientSession() as s:
            body = {
                "model": "orpheus", "voice": "tara", "response_format": "pcm",
                "input": "nginx talks SQL to Kubernetes.",
                "pronunciation_dictionary_locators": [
                    {"pronunciation_dictionary_id": f.id},
                    {"pronunciation_dictionary_id": d.id, "version_id": d.version_id},
                ],
            }  # fmt: skip
            async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
        assert spoken(h)[-1] == "engine x talks sequel to koo-ber-net-eez."

        # Refusals: a phoneme rule names the rule; an unknown id names the id.
        with pytest.raises(ApiError) as e:
            await el.pronunciation_dictionaries.create_from_rules(
                name="ph",
                rules=[PhonemeIn(string_to_replace="tomato", phoneme="təˈmeɪtoʊ", alphabet="ipa")],
            )
        assert e.value.status_code == 400 and "tomato" in json.dumps(e.value.body)
        assert "phoneme" in json.dumps(e.value.body)
        with pytest.raises(ApiError) as e:
            await drain(
                el.text_to_speech.stream(
                    "tara", text="Hello.", output_format="pcm_24000",
                    pronunciation_dictionary_locators=[
                        VersionLocator(pronunciation_dictionary_id="NoSuchDictionary1")
                    ],
                )
            )  # fmt: skip
        assert e.value.status_code == 404 and "NoSuchDictionary1" in json.dumps(e.value.body)
        assert len((await el.pronunciation_dictionaries.list()).pronunciation_dictionaries) == 2


def ws_url(h: Harness, query: str = "") -> str:
    return (
        f"{h.url}/v1/text-to-speech/tara/multi-stream-input?model_id=eleven_flash_v2_5"
        f"&output_format=pcm_24000{query}"
    )


async def ws_turn(
    ws: aiohttp.ClientWebSocketResponse, cid: str, pieces: list[str], first: dict[str, Any]
) -> list[dict[str, Any]]:
    """One context's turn as Pipecat sends it: an opening message, text pieces, a flush and
    a close; the messages received until ``isFinal``."""
    await ws.send_json({"text": " ", "context_id": cid, **first})
    for p in pieces:
        await ws.send_json({"text": p, "context_id": cid})
    await ws.send_json({"context_id": cid, "flush": True})
    await ws.send_json({"context_id": cid, "close_context": True})
    out = []
    while True:
        m = json.loads((await ws.receive(20)).data)
        assert "error" not in m, m
        if m.get("isFinal"):
            return out
        out.append(m)


def chars(messages: list[dict[str, Any]], field: str) -> str:
    return "".join("".join(m[field]["chars"]) for m in messages if m.get(field))


async def test_a_rule_applies_across_websocket_appends_per_context(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, serve=text_serve(tmp_path)) as h:
        d = await client(h).pronunciation_dictionaries.create_from_rules(name="k", rules=[K8S])
        loc = {"pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": d.id}]}
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(ws_url(h, "&apply_text_normalization=on")) as ws,
        ):
            got = await ws_turn(ws, "a", ["We run Kuber", "netes on 3 ", "nodes. "], loc)
            assert spoken(h)[-1] == "We run koo-ber-net-eez on three nodes."
            # alignment: the text the client sent; normalizedAlignment: the text spoken.
            assert chars(got, "alignment") == " We run Kubernetes on 3 nodes. "
            assert chars(got, "normalizedAlignment").strip() == (
                "We run koo-ber-net-eez on three nodes."
            )
            # Another context on the same socket without locators: no rule, still normalised.
            await ws_turn(ws, "b", ["Kubernetes on 3 nodes."], {})
            assert spoken(h)[-1] == "Kubernetes on three nodes."
            # An unknown dictionary is an error naming it, for that context only.
            await ws.send_json(
                {"text": "Hi. ", "context_id": "c",
                 "pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": "Missing123"}]}
            )  # fmt: skip
            m = json.loads((await ws.receive(10)).data)
            assert m["code"] == 404 and "Missing123" in m["message"] and m["contextId"] == "c"


async def test_normalisation_modes_on_each_front_end(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, serve=text_serve(tmp_path, normalization="on")) as h:
        async with aiohttp.ClientSession() as s:
            for mode, want in (
                (None, "It costs three dollars and fifty cents <laugh> today."),
                ("auto", "It costs three dollars and fifty cents <laugh> today."),
                ("off", "It costs $3.50 <laugh> today."),
            ):
                body: dict[str, Any] = {
                    "model": "orpheus", "voice": "tara", "response_format": "pcm",
                    "input": "It costs $3.50 <laugh> today.",
                }  # fmt: skip
                if mode:
                    body["apply_text_normalization"] = mode
                async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                    assert r.status == 200
                    await r.read()
                assert spoken(h)[-1] == want
            body["apply_text_normalization"] = "sometimes"
            async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "apply_text_normalization"
            # ElevenLabs HTTP, with timestamps: alignment over the sent text.
            path = "/v1/text-to-speech/tara/stream/with-timestamps?output_format=pcm_24000"
            async with s.post(f"{h.url}{path}", json={"text": "Take 2 pills."}) as r:
                lines = [json.loads(x) for x in (await r.text()).splitlines() if x]
            al = "".join("".join(x["alignment"]["characters"]) for x in lines if x.get("alignment"))
            nal = "".join(
                "".join(x["normalized_alignment"]["characters"])
                for x in lines
                if x.get("normalized_alignment")
            )
            assert al == "Take 2 pills." and nal == "Take two pills."
            assert spoken(h)[-1] == "Take two pills."
            # Baseten's predict and its WebSocket.
            body = {"prompt": "Room 12 at 9:00.", "voice": "tara", "apply_text_normalization": "on"}
            async with s.post(f"{h.url}/v1/baseten/orpheus/predict", json=body) as r:
                assert r.status == 200
                await r.read()
            assert spoken(h)[-1] == "Room twelve at nine o'clock."
            async with s.ws_connect(f"{h.url}/v1/baseten/orpheus/websocket") as ws:
                await ws.send_json({"voice": "tara", "apply_text_normalization": "off"})
                await ws.send_str("Room 12.")
                await ws.send_str("__END__")
                async for _ in ws:
                    pass
            assert spoken(h)[-1] == "Room 12."


async def test_bad_pls_files_are_refused_with_nothing_stored(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    serve = text_serve(tmp_path, max_pls_bytes=4096)
    async with running_gateway(layout, serve=serve) as h:
        el = client(h)
        bad = {
            "malformed": b"<lexicon><lexeme><grapheme>x</lexeme>",
            "billion_laughs": BILLION_LAUGHS,
            "oversized": PLS.replace(b"</lexicon>", b"<!--" + b"x" * 8000 + b"--></lexicon>"),
            "not_pls": b"<html><body>hi</body></html>",
            "phoneme_only": PLS.replace(
                b"<alias>engine x</alias>", b"<phoneme>\xc9\x9bnd\xca\x92\xc9\xaan</phoneme>"
            ),
        }
        for what, data in bad.items():
            with pytest.raises(ApiError) as e:
                await el.pronunciation_dictionaries.create_from_file(
                    name=what, file=("x.pls", data, "application/pls+xml")
                )
            assert e.value.status_code in (400, 413), (what, e.value.body)
        assert e.value.status_code == 400 and "nginx" in json.dumps(e.value.body)
        assert (await el.pronunciation_dictionaries.list()).pronunciation_dictionaries == []
        d = tmp_path / "pronunciation"
        assert not d.exists() or [n for n in os.listdir(d) if n != ".lock"] == []


async def test_dictionaries_survive_a_restart_and_belong_to_their_key(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    keys = {"api_keys": ["key-a", "key-b"], "admin_keys": ["admin"]}
    async with running_gateway(layout, serve=text_serve(tmp_path), **keys) as h:
        d = await client(h, "key-a").pronunciation_dictionaries.create_from_rules(
            name="mine", rules=[K8S]
        )
    async with running_gateway(layout, serve=text_serve(tmp_path), **keys) as h:
        a, b, admin = client(h, "key-a"), client(h, "key-b"), client(h, "admin")
        assert (await a.pronunciation_dictionaries.get(d.id)).latest_version_id == d.version_id
        assert [
            x.id for x in (await admin.pronunciation_dictionaries.list()).pronunciation_dictionaries
        ] == [d.id]
        assert (await b.pronunciation_dictionaries.list()).pronunciation_dictionaries == []
        with pytest.raises(ApiError) as e:
            await b.pronunciation_dictionaries.get(d.id)
        assert e.value.status_code == 404
        loc = [VersionLocator(pronunciation_dictionary_id=d.id)]
        with pytest.raises(ApiError) as e:
            await drain(
                b.text_to_speech.stream(
                    "tara", text="Kubernetes.", output_format="pcm_24000",
                    pronunciation_dictionary_locators=loc,
                )
            )  # fmt: skip
        assert e.value.status_code == 404
        await drain(
            a.text_to_speech.stream(
                "tara", text="Kubernetes.", output_format="pcm_24000",
                pronunciation_dictionary_locators=loc,
            )
        )  # fmt: skip
        assert spoken(h)[-1] == "koo-ber-net-eez."


async def test_server_default_dictionaries_apply_to_every_request(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with running_gateway(layout, serve=text_serve(tmp_path)) as h:
        d = await client(h).pronunciation_dictionaries.create_from_rules(name="k", rules=[K8S])
    serve = text_serve(tmp_path, pronunciation_dictionaries=[d.id])
    async with running_gateway(layout, serve=serve, zmq=True) as h:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "voice": "tara", "response_format": "pcm", "input": "Kubernetes!"}
            async with s.post(f"{h.url}/v1/audio/speech", json=body) as r:
                assert r.status == 200
                await r.read()
        assert spoken(h)[-1] == "koo-ber-net-eez!"
        # ZeroMQ's open text: the rule holds across appends (the last words wait).
        async with AsyncClient(h.config.gateway.zmq_endpoint or "") as c:
            async with c.stream("We use Kuber", voice="tara") as st:
                await st.append("netes daily")
                await st.append(".", final=True)
                audio = b"".join([x async for x in st])
        assert audio
        sub = h.backend.submitted()[-1]
        appended = "".join(a.text for a in h.backend.appends if a.stream_id == sub.stream_id)
        assert sub.text + appended == "We use koo-ber-net-eez daily."


TURNS = [
    DialogueInput(text="Hi Leo! It costs $5.", voice_id="tara"),
    DialogueInput(text="Hello Tara.", voice_id="leo"),
]


def pause_bytes(ms: int) -> int:
    return int(24000 * ms / 1000) * 2


async def test_text_to_dialogue_with_two_voices_and_timestamps(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    from gateway.frontends.elevenlabs.dialogue import SPEAKER_PAUSE_MS
    from testkit.synthetic_backend import frames_for_text

    async with running_gateway(layout, serve=text_serve(tmp_path, normalization="on")) as h:
        el = client(h)
        audio = b"".join(
            await drain(el.text_to_dialogue.convert(inputs=TURNS, output_format="pcm_24000"))
        )
        said = spoken(h)[-3:]
        assert said == ["Hi Leo!", "It costs five dollars.", "Hello Tara."]
        assert [s.voice for s in h.backend.submitted()[-3:]] == ["tara", "tara", "leo"]
        frames = sum(frames_for_text(t) for t in said)
        assert len(audio) == frames * 4096 + pause_bytes(SPEAKER_PAUSE_MS)

        streamed = b"".join(
            await drain(el.text_to_dialogue.stream(inputs=TURNS, output_format="pcm_24000"))
        )
        assert len(streamed) == len(audio)

        lines = await drain(
            el.text_to_dialogue.stream_with_timestamps(inputs=TURNS, output_format="pcm_24000")
        )
        pcm = b"".join(base64.b64decode(x.audio_base_64) for x in lines)
        assert len(pcm) == len(audio)
        chars = "".join("".join(x.alignment.characters) for x in lines if x.alignment)
        nchars = "".join(
            "".join(x.normalized_alignment.characters) for x in lines if x.normalized_alignment
        )
        assert chars == "Hi Leo! It costs $5.Hello Tara."
        assert nchars == "Hi Leo! It costs five dollars.Hello Tara."
        segs = [s for x in lines for s in x.voice_segments]
        assert [(s.voice_id, s.dialogue_input_index) for s in segs] == [("tara", 0), ("leo", 1)]
        assert segs[0].character_start_index == 0 and segs[1].character_end_index == len(chars)
        assert chars[segs[1].character_start_index : segs[1].character_end_index] == "Hello Tara."
        gap = segs[1].start_time_seconds - segs[0].end_time_seconds
        assert gap == pytest.approx(SPEAKER_PAUSE_MS / 1000, abs=0.002)
        assert segs[1].end_time_seconds == pytest.approx(len(audio) / 48000, abs=0.002)

        whole = await el.text_to_dialogue.convert_with_timestamps(
            inputs=TURNS, output_format="pcm_24000"
        )
        assert len(base64.b64decode(whole.audio_base_64)) == len(audio)
        assert "".join(whole.alignment.characters) == chars
        assert [s.voice_id for s in whole.voice_segments] == ["tara", "leo"]

        # Refusals before any audio: an unknown voice, too many voices, too long.
        n = len(h.backend.submitted())
        bad = [
            [
                DialogueInput(text="Hi.", voice_id="tara"),
                DialogueInput(text="Yo.", voice_id="nobody"),
            ],
            [DialogueInput(text="Hi.", voice_id=f"v{i}") for i in range(11)],
            [DialogueInput(text="x" * 3000, voice_id="tara")] * 2,
        ]
        for inputs in bad:
            with pytest.raises(ApiError) as e:
                await drain(el.text_to_dialogue.convert(inputs=inputs, output_format="pcm_24000"))
            assert e.value.status_code == 400
        # Each turn is under gateway.max_input_chars; together they are over it.
        assert "long-form" in json.dumps(e.value.body)
        assert "gateway.max_input_chars" in json.dumps(e.value.body)
        assert len(h.backend.submitted()) == n


async def test_the_single_context_socket_takes_locators_and_ends_on_empty_text(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """``.../stream-input`` as the SDK's ``convert_realtime`` speaks it (init with ``" "``,
    pieces with ``try_trigger_generation``, ``{"text": ""}`` to end), plus the locators that
    the init message of ElevenLabs' protocol carries."""
    async with running_gateway(layout, serve=text_serve(tmp_path)) as h:
        d = await client(h).pronunciation_dictionaries.create_from_rules(name="k", rules=[K8S])
        url = f"{h.url}/v1/text-to-speech/tara/stream-input?output_format=pcm_24000"
        async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
            await ws.send_json(
                {"text": " ", "try_trigger_generation": True, "xi_api_key": "k",
                 "generation_config": {"chunk_length_schedule": [50]},
                 "pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": d.id}]}
            )  # fmt: skip
            for piece in ("I run Kuber", "netes. And ", "more"):
                await ws.send_json({"text": piece, "try_trigger_generation": True})
            await ws.send_json({"text": ""})
            audio = bytearray()
            final = None
            async for m in ws:
                body = json.loads(m.data)
                assert "error" not in body and "contextId" not in body, body
                if body.get("audio"):
                    audio += base64.b64decode(body["audio"])
                if body.get("isFinal"):
                    final = body
            assert final == {"isFinal": True, "cache": "miss"} and audio
        assert ws.closed
        assert spoken(h)[-2:] == ["I run koo-ber-net-eez.", "And more"]
