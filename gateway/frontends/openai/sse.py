"""Server-sent events of ``stream_format=sse`` (OpenAI's speech events)."""

from __future__ import annotations

import base64

import msgspec

from gateway.errors import APIError, ErrorDetail


class AudioDelta(msgspec.Struct, frozen=True, tag="speech.audio.delta", tag_field="type"):
    audio: str
    """Base64 of the next bytes of the audio in the requested ``response_format``."""


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class AudioDone(msgspec.Struct, frozen=True, tag="speech.audio.done", tag_field="type"):
    usage: Usage


class ErrorEvent(msgspec.Struct, frozen=True, tag="error", tag_field="type"):
    error: ErrorDetail


_encoder = msgspec.json.Encoder()


def _event(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def delta_event(audio: bytes) -> bytes:
    return _event(AudioDelta(base64.b64encode(audio).decode("ascii")))


def done_event(output_tokens: int) -> bytes:
    # The gateway does not tokenize the input: input_tokens is reported as 0.
    return _event(AudioDone(Usage(0, output_tokens, output_tokens)))


def error_event(err: APIError) -> bytes:
    return _event(ErrorEvent(err.body().error))
