"""One request-building path and one API-key check for every front end.

The same bad field sent through OpenAI HTTP, ZeroMQ, the vLLM-Omni, ElevenLabs (WebSocket and
HTTP) and Baseten protocols gets the same code and message (``gateway.schemas.build_params``);
the same keys are accepted and refused over HTTP and ZeroMQ (``gateway.edge.auth``); a request is
checked fully, its voice included, before admission, so a bad one is a 400 even when the
server is full. Against the gateway with its synthetic backend."""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from gateway_harness import Harness, running_gateway, wait_until

from gateway.edge.auth import HTTP_KEY_HINT, ZMQ_KEY_HINT, ApiKeys
from orpheus_wire.zeromq import Audio, Error, Started, server_decoder
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)

Reply = tuple[str, str]
"""(code, message) of a refused request, as the front end tells it."""
Sender = Callable[[Harness, aiohttp.ClientSession, dict[str, Any]], Awaitable[Reply]]

OMNI_PREFIX = "Invalid session config: "
BASETEN_REASON_BYTES = 120
UNKNOWN_VOICE = (
    "unknown voice 'nobody'; voices: tara, leah, jess, leo, dan, mia, zac, zoe "
    "(and the custom voices listed by GET /v1/audio/voices)"
)
INVALID_VOICE = "voice must be 1-64 characters of letters, digits, '_', '-' or '.'"


async def _zmq_call(endpoint: str, msg: dict[str, Any]) -> list[Any]:
    """Send one raw message; the replies up to the first Error, or Started + first Audio."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send(msgspec.msgpack.encode(msg))
        replies: list[Any] = []
        while True:
            assert await sock.poll(10_000), "no reply from the ZeroMQ front end"
            reply = server_decoder.decode(await sock.recv())
            replies.append(reply)
            if isinstance(reply, Error | Audio):
                return replies
    finally:
        sock.close(linger=0)


# -- one sender per front end: the field goes where that protocol carries it ------------------
async def http(h: Harness, s: aiohttp.ClientSession, f: dict[str, Any]) -> Reply:
    body = {"model": "tts-1", "input": "Hello.", "voice": "tara", "response_format": "pcm"}
    body.update({"input" if k == "text" else k: v for k, v in f.items()})
    async with s.post(h.url + "/v1/audio/speech", json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    return err["code"], err["message"]


async def zmq_speak(h: Harness, s: aiohttp.ClientSession, f: dict[str, Any]) -> Reply:
    msg = {"type": "speak", "request_id": 7, "input": "Hello.", "voice": "tara"}
    msg.update({"input" if k == "text" else k: v for k, v in f.items()})
    [err] = await _zmq_call(h.config.gateway.zmq_endpoint or "", msg)
    assert isinstance(err, Error) and (err.request_id, err.status) == (7, 400), err
    return err.code, err.message


async def omni(h: Harness, s: aiohttp.ClientSession, f: dict[str, Any]) -> Reply:
    async with s.ws_connect(h.url + "/v1/audio/speech/stream") as ws:
        config = {"type": "session.config", "voice": "tara", "response_format": "pcm"}
        config.update({k: v for k, v in f.items() if k != "text"})
        await ws.send_json(config)
        if "text" in f:
            await ws.send_json({"type": "input.text", "text": f["text"]})
        ev = json.loads((await ws.receive(10)).data)
    assert ev["type"] == "error", ev
    message = ev["message"]
    if "text" not in f:  # the protocol's wording, as vLLM-Omni's server says it
        assert message.startswith(OMNI_PREFIX)
        message = message[len(OMNI_PREFIX) :]
    return ev["code"], message


def _eleven_path(f: dict[str, Any], tail: str) -> str:
    voice = urllib.parse.quote(f.get("voice", "tara"))
    return f"/v1/text-to-speech/{voice}/{tail}?output_format=pcm_24000"


async def elevenlabs_ws(h: Harness, s: aiohttp.ClientSession, f: dict[str, Any]) -> Reply:
    url = h.url + _eleven_path(f, "multi-stream-input")
    if "voice" in f:  # in the path: refused before the upgrade, as an HTTP error
        async with s.get(url) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        return err["code"], err["message"]
    msg: dict[str, Any] = {"text": f.get("text", "Hi. "), "context_id": "c"}
    if "speed" in f:
        msg["voice_settings"] = {"speed": f["speed"]}
    async with s.ws_connect(url) as ws:
        await ws.send_json(msg)
        ev = json.loads((await ws.receive(10)).data)
    assert ev["code"] == 400 and ev["contextId"] == "c", ev
    return ev["error"], ev["message"]


async def elevenlabs_http(h: Harness, s: aiohttp.ClientSession, f: dict[str, Any]) -> Reply:
    body: dict[str, Any] = {"text": f.get("text", "Hello."), "model_id": "eleven_flash_v2_5"}
    if "speed" in f:
        body["voice_settings"] = {"speed": f["speed"]}
    if "seed" in f:
        body["seed"] = f["seed"]
    async with s.post(h.url + _eleven_path(f, "stream"), json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    return err["code"], err["message"]


async def baseten(h: Harness, s: aiohttp.ClientSession, f: dict[str, Any]) -> Reply:
    async with s.ws_connect(h.url + "/v1/baseten/orpheus/websocket") as ws:
        await ws.send_json({"voice": "tara", **{k: v for k, v in f.items() if k != "text"}})
        if "text" in f:
            await ws.send_str(f["text"])
        msg = await ws.receive(10)
    assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1008, msg
    return "", msg.extra  # the protocol has no error message: a close code and its reason


SENDERS: dict[str, Sender] = {
    "http": http,
    "zmq": zmq_speak,
    "omni": omni,
    "elevenlabs_ws": elevenlabs_ws,
    "elevenlabs_http": elevenlabs_http,
    "baseten": baseten,
}
ALL = tuple(SENDERS)
TEXT_FIELD = {"http": "input", "zmq": "input"}
"""The name a front end's own field for the text has (the message names it); else "text"."""

CASES = [
    # field and value, code, message ({field}: the front end's name of its text field), where
    ({"voice": "nobody"}, "bad_request", UNKNOWN_VOICE, ALL),
    ({"voice": "ta ra"}, "invalid_voice", INVALID_VOICE, ALL),
    ({"speed": 9}, "invalid_request", "Expected `float` <= 4.0 - at `$.speed`",
     ("http", "zmq", "omni", "elevenlabs_ws", "elevenlabs_http")),
    ({"temperature": 7}, "invalid_request", "Expected `float` <= 2.0 - at `$.temperature`",
     ("http", "zmq", "omni", "baseten")),
    ({"repetition_penalty": 2.5}, "invalid_request",
     "Expected `float` <= 2.0 - at `$.repetition_penalty`", ("http", "zmq", "omni", "baseten")),
    ({"max_tokens": 4097}, "invalid_request", "Expected `int` <= 4096 - at `$.max_tokens`",
     ("http", "zmq")),
    ({"max_tokens": 6}, "invalid_request", "Expected `int` >= 7 - at `$.max_tokens`",
     ("http", "zmq")),
    ({"max_tokens": 70, "text_open": True}, "invalid_request",
     "max_tokens fixes the length of a complete text: not with text_open", ("zmq",)),
    ({"top_p": 0}, "invalid_request", "Expected `float` > 0.0 - at `$.top_p`",
     ("http", "zmq", "omni", "baseten")),
    ({"seed": -1}, "invalid_request", "Expected `int` >= 0 - at `$.seed`",
     ("http", "zmq", "omni", "elevenlabs_http")),
    ({"top_k": -1}, "invalid_request", "Expected `int` >= 0 - at `$.top_k`",
     ("http", "zmq", "omni", "baseten")),
    ({"top_k": 1.5}, "invalid_request", "Expected `int | null`, got `float` - at `$.top_k`",
     ("http",)),
    ({"response_format": "ogg"}, "invalid_request",
     "Invalid enum value 'ogg' - at `$.response_format`", ("http", "zmq", "omni")),
    ({"sample_rate": 12345}, "invalid_request", "Invalid enum value 12345 - at `$.sample_rate`",
     ("http", "zmq", "omni")),
    ({"response_format": "opus", "sample_rate": 22050}, "invalid_request",
     "opus at 22050 Hz: opus takes 8000, 16000, 24000 or 48000 Hz", ("http", "zmq", "omni")),
    ({"text": "Hello\x00there."}, "invalid_request", "`{field}` contains a NUL character", ALL),
]  # fmt: skip


@pytest.mark.parametrize(
    ("field", "code", "message", "front_ends"),
    CASES,
    ids=[",".join(f"{k}={v!r}" for k, v in c[0].items()) for c in CASES],
)
async def test_a_bad_field_gets_one_answer_through_every_front_end(
    layout: InstanceLayout, field: dict[str, Any], code: str, message: str, front_ends: tuple
) -> None:
    async with running_gateway(layout, zmq=True) as h, aiohttp.ClientSession() as s:
        for name in front_ends:
            got_code, got = await SENDERS[name](h, s, field)
            want = message.format(field=TEXT_FIELD.get(name, "text"))
            if name == "baseten":  # a close reason is cut at 120 bytes; there is no code
                assert got == want.encode()[:BASETEN_REASON_BYTES].decode(), name
            else:
                assert (got_code, got) == (code, want), name
        assert h.backend.submitted() == []  # nothing bad reached the workers
        assert h.gateway.active_streams == 0


# -- API keys ----------------------------------------------------------------------------------
def test_api_keys_compare_every_key_and_allow_all_without_keys() -> None:
    assert ApiKeys([]).allows(None) and ApiKeys([]).allows("anything")
    assert not ApiKeys([]).required
    keys = ApiKeys(["k1", "sekret"])
    assert keys.required
    assert keys.allows("k1") and keys.allows("sekret")
    for bad in (None, "", "k", "k12", "sekre", "SEKRET", "sekret ", "ключ"):
        assert not keys.allows(bad), bad


async def test_http_and_zmq_take_and_refuse_the_same_keys(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, zmq=True, api_keys=["k1", "k2"]) as h,
        aiohttp.ClientSession() as s,
    ):
        ep = h.config.gateway.zmq_endpoint or ""
        speak = {"type": "speak", "request_id": 1, "input": "Hi.", "voice": "tara"}
        body = {"model": "tts-1", "input": "Hi.", "voice": "tara", "response_format": "pcm"}
        for key in (None, "", "wrong", "k"):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            async with s.post(h.url + "/v1/audio/speech", json=body, headers=headers) as r:
                assert r.status == 401
                err = (await r.json())["error"]
                assert (err["code"], err["message"]) == ("invalid_api_key", HTTP_KEY_HINT)
            [e] = await _zmq_call(ep, {**speak, "api_key": key})
            assert (e.status, e.code, e.message) == (401, "invalid_api_key", ZMQ_KEY_HINT)
        # The key is checked before the request: a bad field without a key is still a 401.
        async with s.post(h.url + "/v1/audio/speech", json={**body, "speed": 9}) as r:
            assert r.status == 401
        [e] = await _zmq_call(ep, {**speak, "speed": 9})
        assert e.status == 401
        for key in ("k1", "k2"):
            hdr = {"Authorization": f"Bearer {key}"}
            async with s.post(h.url + "/v1/audio/speech", json=body, headers=hdr) as r:
                assert r.status == 200 and await r.read()
            started, audio = await _zmq_call(ep, {**speak, "api_key": key})
            assert isinstance(started, Started) and isinstance(audio, Audio)
        async with s.get(h.url + "/health") as r:  # only /v1/* needs a key
            assert r.status == 200
        await wait_until(lambda: h.gateway.active_streams == 0, what="streams closed")


# -- validation before admission ---------------------------------------------------------------
LONG = {"model": "tts-1", "input": "x" * 200, "voice": "tara", "response_format": "pcm"}


@contextlib.asynccontextmanager
async def full_gateway(layout: InstanceLayout) -> AsyncIterator[tuple[Any, aiohttp.ClientSession]]:
    """A gateway with one slot, held by a streaming request for the whole block."""
    async with (
        running_gateway(
            layout, zmq=True, max_active_streams=1, max_queued_streams=0,
            backend={"realtime": True},
        ) as h,
        aiohttp.ClientSession() as s,
    ):  # fmt: skip
        async with s.post(h.url + "/v1/audio/speech", json=LONG) as holder:
            assert holder.status == 200  # holds the only slot while it streams
            await holder.content.readany()
            yield h, s
        await wait_until(lambda: h.gateway.active_streams == 0, what="the holder closed")


async def test_a_bad_voice_is_a_400_even_when_the_server_is_full(layout: InstanceLayout) -> None:
    async with full_gateway(layout) as (h, s):
        good = {**LONG, "input": "Hi."}
        async with s.post(h.url + "/v1/audio/speech", json=good) as r:
            assert r.status == 429  # the server is full...
        for voice, code, message in (
            ("nobody", "bad_request", UNKNOWN_VOICE),
            ("ta ra", "invalid_voice", INVALID_VOICE),
        ):  # ...and a request that can never succeed is told so, not to retry later
            bad = {"voice": voice}
            assert await http(h, s, bad) == (code, message)
            assert await zmq_speak(h, s, bad) == (code, message)
            assert await omni(h, s, bad) == (code, message)
            assert await elevenlabs_http(h, s, bad) == (code, message)
            assert await elevenlabs_ws(h, s, bad) == (code, message)
            assert message.startswith((await baseten(h, s, bad))[1])
        assert [sub.voice for sub in h.backend.submitted()] == ["tara"]
        assert h.metric(
            "orpheus_gateway_requests_total", {"api": "http", "outcome": "rejected"}
        ) == 1  # fmt: skip


LIMIT_CASES = [
    # a sampling field the llm_worker refuses (common.limits), and the front ends carrying it
    ({"temperature": 2.5}, "Expected `float` <= 2.0 - at `$.temperature`",
     ("http", "zmq", "omni", "baseten")),
    ({"repetition_penalty": 0.25}, "Expected `float` >= 0.5 - at `$.repetition_penalty`",
     ("http", "zmq", "omni", "baseten")),
    ({"max_tokens": 4097}, "Expected `int` <= 4096 - at `$.max_tokens`", ("http", "zmq")),
    ({"top_k": -1}, "Expected `int` >= 0 - at `$.top_k`", ("http", "zmq", "omni", "baseten")),
]  # fmt: skip


async def test_a_sampling_value_the_worker_refuses_is_a_400_even_when_the_server_is_full(
    layout: InstanceLayout,
) -> None:
    """The gateway refuses what the llm_worker would refuse (``common.limits``) before
    admission: a 400 that says why, not a 429 that invites the client to retry it."""
    async with full_gateway(layout) as (h, s):
        at_limit = {**LONG, "input": "Hi.", "temperature": 2.0, "repetition_penalty": 0.5,
                    "max_tokens": 4096}  # fmt: skip
        async with s.post(h.url + "/v1/audio/speech", json=at_limit) as r:
            assert r.status == 429  # the server is full, and this one is within limits
        for field, message, front_ends in LIMIT_CASES:
            for name in front_ends:
                code, got = await SENDERS[name](h, s, field)
                if name == "baseten":
                    assert message.startswith(got), name
                else:
                    assert (code, got) == ("invalid_request", message), name
        assert [sub.voice for sub in h.backend.submitted()] == ["tara"]
