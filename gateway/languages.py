"""The languages this server speaks: of the checkpoint, and of each voice.

The one place the listings ask (ElevenLabs' ``GET /v1/voices``, ``GET /v2/voices``,
``GET /v1/models``): a checkpoint speaks ``checkpoint_languages``, a voice
``voice_languages`` (the first is its language label). Until the configuration or the
checkpoint's directory names them, both are English.
"""

from __future__ import annotations

from common.config import ServeConfig

DEFAULT_LANGUAGES: tuple[str, ...] = ("en",)
"""What a checkpoint, or a voice, speaks when nothing says otherwise."""

LANGUAGE_NAMES = {
    "en": "English",
    "fr": "French",
    "de": "German",
    "es": "Spanish",
    "it": "Italian",
    "ko": "Korean",
    "hi": "Hindi",
    "zh": "Chinese",
    "ja": "Japanese",
    "pt": "Portuguese",
}
"""Display names of ISO 639-1 codes (ElevenLabs' ``LanguageResponse.name``); a code not
here is shown as itself."""


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


def checkpoint_languages(config: ServeConfig) -> tuple[str, ...]:
    """The languages the served checkpoint speaks, its main one first."""
    del config  # the configuration does not name them yet
    return DEFAULT_LANGUAGES


def voice_languages(config: ServeConfig, voice: str) -> tuple[str, ...]:
    """The languages ``voice`` (a built-in, custom or LoRA voice's id) speaks, its own first:
    the checkpoint's main language unless the voice names its own."""
    del voice  # no voice names its language yet
    return checkpoint_languages(config)[:1]
