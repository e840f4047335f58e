"""ElevenLabs' text-to-speech wire types: paths, output formats, the WebSocket's messages and
the streaming HTTP bodies (``websocket`` and ``http`` serve them)."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from gateway.apis import Api
from gateway.audio.formats import ELEVENLABS_FORMATS, OutputFormat
from gateway.errors import APIError
from gateway.frontends.alignment import CharTimes
from gateway.schemas import SpeechParams, build_params
from gateway.service import Gateway
from gateway.text.breaks import cap_ms
from gateway.text.plan import TextPlan
from orpheus_wire.text import Locator
from shm.messages import SamplingOverrides

API = Api.ELEVENLABS
WS_PATH = "/v1/text-to-speech/{voice_id}/multi-stream-input"
WS_SINGLE_PATH = "/v1/text-to-speech/{voice_id}/stream-input"
STREAM_PATH = "/v1/text-to-speech/{voice_id}/stream"
TIMESTAMPS_PATH = "/v1/text-to-speech/{voice_id}/stream/with-timestamps"
CONVERT_PATH = "/v1/text-to-speech/{voice_id}"
CONVERT_TIMESTAMPS_PATH = "/v1/text-to-speech/{voice_id}/with-timestamps"
DEFAULT_FORMAT = "mp3_44100_128"
MAX_CONTEXTS = 16
"""Open contexts per socket (ElevenLabs allows 5; clients that leave contexts open while
they start new ones are common, so this is more generous)."""


def output_format(request: web.Request) -> OutputFormat:
    name = request.query.get("output_format", DEFAULT_FORMAT)
    fmt = ELEVENLABS_FORMATS.get(name)
    if fmt is None:
        raise APIError(
            400,
            "invalid_output_format",
            f"output_format {name!r} is not supported; use one of {', '.join(ELEVENLABS_FORMATS)}",
            param="output_format",
        )
    return fmt


def params_for(
    request: web.Request,
    gateway: Gateway,
    fmt: OutputFormat,
    *,
    text: str = "",
    max_chars: int | None = None,
    speed: float | None = None,
    seed: int | None = None,
    text_plan: TextPlan | None = None,
) -> SpeechParams:
    """The request's ``SpeechParams`` (``build_params``): the path's voice, the format named
    by ``output_format``; with no text, the template of a socket or a context."""
    return build_params(
        gateway.voices,
        gateway.limits,
        text=text,
        voice=request.match_info["voice_id"],
        max_chars=max_chars,
        text_param="text",
        allow_empty=max_chars is None,
        response_format=fmt.codec,
        sample_rate=fmt.sample_rate,
        bitrate=fmt.bitrate,
        speed=speed,
        sampling=SamplingOverrides(seed=seed),
        text_plan=text_plan,
        max_break_ms=cap_ms(gateway.config.gateway.max_break_s),
    )


class VoiceSettings(msgspec.Struct):
    """Only ``speed`` is honoured; ``stability``, ``similarity_boost``, ``style`` and
    ``use_speaker_boost`` (sent by most clients, with the voice's defaults) are ignored
    (docs/api.md)."""

    speed: float | None = None


class ClientMessage(msgspec.Struct, kw_only=True):
    """One WebSocket message; fields this server has no use for are ignored."""

    text: str | None = None
    context_id: str | None = None
    flush: bool = False
    close_context: bool = False
    close_socket: bool = False
    voice_settings: VoiceSettings | None = None
    pronunciation_dictionary_locators: list[Locator] | None = None
    """On a context's first message: its dictionaries (the socket's query has none)."""


class AudioMessage(msgspec.Struct, omit_defaults=True):
    audio: str | None
    contextId: str
    alignment: CharTimes | None = None
    normalizedAlignment: CharTimes | None = None


class FinalMessage(msgspec.Struct):
    contextId: str
    isFinal: bool = True
    cache: str | msgspec.UnsetType = msgspec.UNSET
    """Extension: ``hit`` (the context's audio came from the sentence audio cache),
    ``partial`` (some of its sentences did), ``miss``; absent when nothing of it could be
    cached (the cache off) (``gateway.cache.control.combined``)."""


class SingleAudioMessage(msgspec.Struct, omit_defaults=True):
    """An audio message of the single-context socket (no ``contextId``)."""

    audio: str | None
    alignment: CharTimes | None = None
    normalizedAlignment: CharTimes | None = None


class SingleFinalMessage(msgspec.Struct):
    isFinal: bool = True
    cache: str | msgspec.UnsetType = msgspec.UNSET
    """As ``FinalMessage``'s."""


class ErrorMessage(msgspec.Struct, omit_defaults=True):
    error: str
    message: str
    code: int
    contextId: str | None = None


class SpeechBody(msgspec.Struct, kw_only=True):
    """Body of the four ``POST /v1/text-to-speech/{voice_id}...`` routes. Fields this server
    cannot honour are ignored (``previous_text``, ``next_text``, ``previous_request_ids``,
    ``next_request_ids``, ``use_pvc_as_ivc``, any ``model_id``), except those that would
    change the audio: ``refuse_unsupported`` (docs/api.md lists each)."""

    text: str
    model_id: str | None = None
    seed: int | None = None
    voice_settings: VoiceSettings | None = None
    pronunciation_dictionary_locators: list[Locator] | None = None
    apply_text_normalization: str | None = None
    audio_effects: Any = None
    """Reverb, filters, background noise: refused (``refuse_unsupported``)."""
    language_code: str | None = None
    """ISO 639-1; None: the voice's language (``gateway.voices.languages``)."""


def refuse_unsupported(body: SpeechBody) -> None:
    """APIError 400 for a field whose effect this server cannot give, rather than audio
    without it."""
    if body.audio_effects:  # None, {}: no effect asked for
        raise APIError(
            400,
            "unsupported_field",
            "audio_effects are not supported by this server; send the request without them",
            param="audio_effects",
        )


class HttpAlignment(msgspec.Struct):
    characters: list[str]
    character_start_times_seconds: list[float]
    character_end_times_seconds: list[float]


class WholeTimestamps(msgspec.Struct):
    """Body of ``POST .../with-timestamps`` (``convert_with_timestamps``)."""

    audio_base64: str
    alignment: HttpAlignment | None
    normalized_alignment: HttpAlignment | None


class TimestampChunk(msgspec.Struct, omit_defaults=True):
    audio_base64: str | None = None
    alignment: HttpAlignment | None = None
    normalized_alignment: HttpAlignment | None = None
