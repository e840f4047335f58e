"""vLLM-Omni's streaming speech protocol on the wire: the client's ``session.config`` and the
server's messages (``gateway.frontends.omni.speech_stream`` serves them)."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.frontends.omni.units import Granularity
from orpheus_wire.sampling import SamplingFields
from orpheus_wire.text import Locator


class SessionConfig(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """``session.config``. Fields vLLM-Omni has for other models (``task_type``,
    ``instructions``, ``ref_audio``, ...) are accepted and ignored, as is
    ``max_tokens`` (the units of a stream have their own lengths). The values of the fields
    every front end has are checked by ``build_params``; the sampling fields are
    ``SamplingFields``'."""

    model: str | None = None
    voice: str | None = None
    speaker: str | None = None
    language: str | None = None
    """An ISO 639-1 code or vLLM-Omni's English name (``"French"``); None or ``"Auto"``:
    the voice's language (``gateway.voices.languages``)."""
    response_format: str = "wav"
    sample_rate: int | None = None
    speed: float | None = 1.0
    stream_audio: bool = False
    word_timestamps: bool = False
    timestamp_type: str | None = None
    split_granularity: Granularity = "none"
    pronunciation_dictionary_locators: list[Locator] | None = None
    """Extension (ElevenLabs' field): up to 3 pronunciation dictionaries, in order."""
    apply_text_normalization: str | None = None
    """Extension (ElevenLabs' field): ``auto``, ``on``, ``off``."""


# -- server messages -----------------------------------------------------------------------
class AudioStart(msgspec.Struct, tag="audio.start", tag_field="type", omit_defaults=True):
    utterance_index: int
    sentence_index: int
    sentence_text: str
    format: str
    sample_rate: int | None = None
    channels: int | None = None
    word_timestamps: bool = False
    ai_generated: bool | None = None
    """True in every message the server sends: the audio is AI-generated."""
    watermark: str | None = None
    """What marks the audio itself (``gateway.disclosure.headers.watermark_of``), or "none"."""


class WordAlignment(msgspec.Struct):
    words: list[str]
    word_start_times_seconds: list[float]
    word_end_times_seconds: list[float]


class TimestampInfo(msgspec.Struct):
    word_alignment: WordAlignment
    estimated: bool = True


class AudioDone(msgspec.Struct, tag="audio.done", tag_field="type", omit_defaults=True):
    utterance_index: int
    sentence_index: int
    total_bytes: int
    error: bool
    timestamp_info: TimestampInfo | None = None
    cache: str | None = None
    """Extension: ``hit`` (the sentence's audio came from the sentence audio cache),
    ``partial`` (some of its spoken units did), ``miss``; absent when nothing of it could be
    cached (the cache off) (``gateway.cache.control.combined``)."""


class AudioChunk(msgspec.Struct, tag="audio.chunk", tag_field="type"):
    utterance_index: int
    sentence_index: int
    chunk_id: int
    chunk_start_ms: int
    chunk_end_ms: int
    sample_rate: int
    channels: int
    audio_b64: str
    timestamps: list[dict[str, Any]] | None


class SessionDone(msgspec.Struct, tag="session.done", tag_field="type"):
    utterance_index: int
    total_sentences: int


class ErrorMessage(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    message: str
    code: str | None = None
    partial_audio: bool = False
    action: str | None = None
