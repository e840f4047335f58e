"""Request bodies the gateway accepts, and their validation into ``SpeechParams``.

Decoding is strict (msgspec with ``forbid_unknown_fields``): a misspelt field is a 400
that names it, as OpenAI answers, instead of a silently ignored option.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gateway.audio_out import OutputFormat, check_format
from gateway.errors import APIError
from gateway.voices import VoiceCatalog
from shm.messages import SamplingOverrides

ResponseFormat = Literal["pcm", "wav", "mp3", "opus", "aac", "flac", "ulaw", "alaw"]
SampleRate = Literal[8000, 16000, 22050, 24000, 44100, 48000]
StreamFormat = Literal["audio", "sse"]
Speed = Annotated[float, Meta(ge=0.25, le=4.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=1 << 20)]
Seed = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=5.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
ModelName = Annotated[str, Meta(min_length=1, max_length=256)]


class VoiceRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenAI's object form of a voice: ``{"id": "..."}``."""

    id: str


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Extensions to OpenAI's request shared by every front end."""

    max_tokens: MaxTokens | None = None
    """Upper bound on audio tokens (7 per 85 ms frame); the server also caps by text length."""
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    repetition_penalty: RepetitionPenalty | None = None

    def overrides(self) -> SamplingOverrides:
        return SamplingOverrides(
            temperature=self.temperature,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_tokens,
            seed=self.seed,
        )


class SpeechRequest(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/audio/speech`` (OpenAI's fields plus ``SamplingFields``)."""

    model: ModelName
    input: str
    voice: str | VoiceRef
    response_format: ResponseFormat = "mp3"
    sample_rate: SampleRate | None = None
    """Extension (as vLLM-Omni's): the rate of the audio sent; None: 24000 (8000 for
    ``ulaw``/``alaw``)."""
    speed: Speed = 1.0
    stream_format: StreamFormat = "audio"
    instructions: str | None = None
    """Accepted for compatibility with gpt-4o-mini-tts clients; Orpheus has no use for it."""


class SpeechParams(msgspec.Struct, frozen=True, kw_only=True):
    """A validated utterance request, whatever front end it came from."""

    text: str
    voice: str
    """The model voice (aliases already resolved)."""
    sampling: SamplingOverrides = SamplingOverrides()
    response_format: ResponseFormat = "pcm"
    sample_rate: int | None = None
    speed: float = 1.0
    stream_format: StreamFormat = "audio"

    @property
    def output(self) -> OutputFormat:
        return output_format(self.response_format, self.sample_rate)


def output_format(codec: ResponseFormat, sample_rate: int | None) -> OutputFormat:
    """The ``OutputFormat`` of an OpenAI-style ``response_format`` + ``sample_rate``;
    APIError 400 for a pair this server cannot make (``opus`` at 22050 Hz, ...)."""
    rate = sample_rate or (8000 if codec in ("ulaw", "alaw") else 24000)
    fmt = OutputFormat(codec, rate)
    try:
        check_format(fmt)
    except ValueError as e:
        raise bad_request(f"{codec} at {rate} Hz: {e}", param="sample_rate") from None
    return fmt


_speech_decoder = msgspec.json.Decoder(SpeechRequest)


def bad_request(
    message: str, *, code: str = "invalid_request", param: str | None = None
) -> APIError:
    return APIError(400, code, message, param=param)


_PATH_RE = re.compile(r"at `\$\.([A-Za-z_]+)")
_FIELD_RE = re.compile(r"field `([A-Za-z_]+)`")


def _param_of(err: msgspec.ValidationError) -> str | None:
    """The top-level field a msgspec error is about (``param`` of the JSON error)."""
    m = _PATH_RE.search(str(err)) or _FIELD_RE.search(str(err))
    return m.group(1) if m else None


def decode_speech_request(body: bytes) -> SpeechRequest:
    try:
        return _speech_decoder.decode(body)
    except msgspec.ValidationError as e:
        raise bad_request(str(e), param=_param_of(e)) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None


def check_text(
    text: str, max_chars: int, *, param: str = "input", allow_empty: bool = False
) -> str:
    if not allow_empty and not text.strip():
        raise bad_request(f"`{param}` must contain some text", code="empty_input", param=param)
    if len(text) > max_chars:
        raise bad_request(
            f"`{param}` has {len(text)} characters; the limit is {max_chars}",
            code="input_too_long",
            param=param,
        )
    if "\x00" in text:
        raise bad_request(f"`{param}` contains a NUL character", param=param)
    return text


def speech_params(req: SpeechRequest, voices: VoiceCatalog, max_chars: int) -> SpeechParams:
    voice = req.voice if isinstance(req.voice, str) else req.voice.id
    return SpeechParams(
        text=check_text(req.input, max_chars),
        voice=voices.resolve(voice),
        sampling=req.overrides(),
        response_format=req.response_format,
        sample_rate=output_format(req.response_format, req.sample_rate).sample_rate,
        speed=req.speed,
        stream_format=req.stream_format,
    )
