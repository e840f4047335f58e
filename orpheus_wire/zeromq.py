"""The gateway's ZeroMQ protocol for internal clients (msgpack-encoded msgspec Structs).

Transport: the gateway binds a ROUTER at ``gateway.zmq_endpoint``; a client connects a
DEALER and sends one-frame messages; the gateway answers with one-frame messages (ROUTER
adds and strips the identity frame). Every message is a msgpack map whose ``type`` field
names it. A client chooses ``request_id`` values, unique among its own open requests, and
may run many requests at once on one socket.

    client -> gateway   Speak, AppendText, Cancel
    gateway -> client   Started, Audio (in order, seq 0, 1, ...), then Done or Error

``Audio.data`` holds the next bytes of the response format (``pcm``: int16 LE mono 24 kHz).
Errors carry the HTTP status the same failure has over HTTP. See docs/api.md.

The gateway serves these types (``gateway.frontends.zeromq.server``) and the client library
speaks them (``orpheus_client.zmq_client``); they import nothing but msgspec.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from orpheus_wire.sampling import SamplingFields
from orpheus_wire.text import Locator


class Speak(SamplingFields, frozen=True, kw_only=True, tag="speak", tag_field="type"):
    """The values of the fields every front end has are checked as HTTP's are (the
    gateway's ``build_params``): a bad one is an ``Error`` with the same code and
    message as the HTTP 400."""

    request_id: int
    input: str
    voice: str = ""
    """Model voice or OpenAI alias; empty: the model's default voice."""
    model: str = ""
    response_format: str = "pcm"
    """pcm, wav, mp3, opus, aac, flac, ulaw or alaw (docs/api.md)."""
    sample_rate: int | None = None
    """None: 24000 (8000 for ``ulaw``/``alaw``)."""
    speed: float = 1.0
    text_open: bool = False
    """True: more text follows in ``AppendText`` messages (the last one has ``final``)."""
    api_key: str | None = None
    """Required when the server has API keys configured."""
    pronunciation_dictionary_locators: list[Locator] | None = None
    """Up to 3 pronunciation dictionaries (ElevenLabs' field), applied in order."""
    apply_text_normalization: str | None = None
    """``auto`` (the server's ``text.normalization``), ``on``, ``off``. With ``text_open``
    the last words of each piece wait for the next one, so that a rule or a number is never
    split across ``AppendText`` messages."""
    traceparent: str | None = None
    """A W3C trace context (the HTTP ``traceparent`` header's value): when the server traces
    (OpenTelemetry), the request's spans continue this trace; else it starts one."""
    language: str | None = None
    """The text's language (ISO 639-1, ``fr``): its normalisation and dictionaries. None:
    the voice's, else the server's."""
    cache: Literal["use", "no-cache", "no-store"] | None = None
    """What the request lets the server's sentence audio cache do, as HTTP's
    ``Cache-Control``: ``no-store`` neither reads nor writes it, ``no-cache`` synthesises
    again and stores; None: ``use``."""


class AppendText(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="append", tag_field="type"
):
    request_id: int
    text: str
    final: bool = False


class Cancel(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="cancel", tag_field="type"
):
    request_id: int


class Started(msgspec.Struct, frozen=True, tag="started", tag_field="type"):
    """The request was admitted (it may have waited in the queue)."""

    request_id: int
    stream_id: int
    sample_rate: int
    response_format: str
    ai_generated: bool = True
    """The audio is AI-generated (always: it says so for a reader that keeps this message)."""
    watermark: str = "none"
    """What marks the audio itself (the server's watermark, by name), or "none"."""


class Audio(msgspec.Struct, frozen=True, tag="audio", tag_field="type"):
    request_id: int
    seq: int
    data: bytes


class Done(msgspec.Struct, frozen=True, tag="done", tag_field="type", omit_defaults=True):
    request_id: int
    reason: str
    """"stop", "length", "cancelled" (after the client's Cancel), ..."""
    audio_seconds: float
    frames: int
    cache: str = ""
    """``hit`` (the audio came from the server's sentence audio cache), ``partial`` (its
    first sentences did), ``miss``; empty: the cache is off or the text could not be cached
    (open text, break tags): left out of the message, whose bytes are then those of a
    server without the cache."""


class Error(msgspec.Struct, frozen=True, tag="error", tag_field="type", omit_defaults=True):
    request_id: int | None
    """None when the message that failed could not be decoded."""
    status: int
    code: str
    message: str
    retry_after_s: int | None = None
    """Seconds after which the same request may succeed (a full node, a worker restart);
    None (left out of the message: the bytes of before): retrying will not help."""


ClientMessage = Speak | AppendText | Cancel
ServerMessage = Started | Audio | Done | Error

encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
server_decoder = msgspec.msgpack.Decoder(ServerMessage)


def endpoint_for(endpoint: str, index: int) -> str:
    """The endpoint gateway process ``index`` binds: tcp port + index, or ``path-index``."""
    if index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + index}"
    return f"{endpoint}-{index}"
