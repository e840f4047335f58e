"""The body of ``POST /v1/audio/speech``: OpenAI's fields plus ``SamplingFields`` and the
extensions other protocols brought (``sample_rate``, dictionaries, normalisation, language),
decoded strictly (msgspec with ``forbid_unknown_fields``: a misspelt field is a 400 that
names it, as OpenAI answers, instead of a silently ignored option) and turned into
``SpeechParams`` through ``gateway.schemas.build_params``, as every front end's request is."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from common.limits import RequestLimits
from gateway.schemas import (
    SpeechParams,
    VoiceRef,
    bad_request,
    build_params,
    param_of,
    sampling_overrides,
)
from gateway.text.breaks import DEFAULT_MAX_MS
from gateway.text.plan import TextPlan
from gateway.voices.catalogue import VoiceCatalog
from orpheus_wire.sampling import SamplingFields
from orpheus_wire.text import Locator

ModelName = Annotated[str, Meta(min_length=1, max_length=256)]


class SpeechRequest(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/audio/speech`` (OpenAI's fields plus ``SamplingFields``)."""

    model: ModelName
    input: str
    voice: str | VoiceRef
    response_format: str = "mp3"
    sample_rate: int | None = None
    """Extension (as vLLM-Omni's): the rate of the audio sent; None: 24000 (8000 for
    ``ulaw``/``alaw``)."""
    speed: float = 1.0
    stream_format: str = "audio"
    instructions: str | None = None
    """Accepted for compatibility with gpt-4o-mini-tts clients; Orpheus has no use for it."""
    pronunciation_dictionary_locators: list[Locator] | None = None
    """Extension (ElevenLabs' field): up to 3 pronunciation dictionaries, applied in order."""
    apply_text_normalization: str | None = None
    """Extension (ElevenLabs' field): ``auto`` (the server's ``text.normalization``), ``on``,
    ``off``."""
    language: str | None = None
    """Extension (vLLM-Omni's field): the text's language (ISO 639-1, ``fr``); None: the
    voice's, else the checkpoint's (``gateway.voices.languages``)."""

    @property
    def voice_name(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id


_speech_decoder = msgspec.json.Decoder(SpeechRequest)


def decode_speech_request(body: bytes) -> SpeechRequest:
    try:
        return _speech_decoder.decode(body)
    except msgspec.ValidationError as e:
        raise bad_request(str(e), param=param_of(e)) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None


def speech_params(
    req: SpeechRequest,
    voices: VoiceCatalog,
    limits: RequestLimits,
    max_chars: int,
    text_plan: TextPlan | None = None,
    max_break_ms: int = DEFAULT_MAX_MS,
) -> SpeechParams:
    """``POST /v1/audio/speech``'s body through ``build_params``."""
    return build_params(
        voices,
        limits,
        text=req.input,
        voice=req.voice if isinstance(req.voice, str) else req.voice.id,
        max_chars=max_chars,
        response_format=req.response_format,
        sample_rate=req.sample_rate,
        speed=req.speed,
        stream_format=req.stream_format,
        sampling=sampling_overrides(req),
        text_plan=text_plan,
        max_break_ms=max_break_ms,
    )
