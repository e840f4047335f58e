"""Voice names: OpenAI aliases mapped to model voices, model voices passed through.

The gateway does not own the model's voice list (the llm_worker does, and answers an
unknown voice with an ``ERROR`` record of status 400). It validates only the *shape* of a
name, so that nothing but a plain identifier ever reaches the prompt ``"{voice}: {text}"``.
"""

from __future__ import annotations

import re

import msgspec

from gateway.errors import APIError

ENGLISH_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
"""Voices of the English Orpheus checkpoints, used when the configuration names none."""

_VOICE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class VoiceList(msgspec.Struct, frozen=True):
    """Body of ``GET /v1/audio/voices``."""

    voices: list[str]
    aliases: dict[str, str]
    default: str


class VoiceCatalog:
    def __init__(self, aliases: dict[str, str], model_voices: list[str], default: str) -> None:
        self._aliases = {k.lower(): v for k, v in aliases.items()}
        self.model_voices = list(model_voices)
        self.default = default
        self.listing = VoiceList(voices=self.model_voices, aliases=dict(aliases), default=default)

    def resolve(self, name: str) -> str:
        """The model voice for ``name``: an alias target, or ``name`` itself."""
        alias = self._aliases.get(name.lower())
        if alias is not None:
            return alias
        if not _VOICE_RE.match(name):
            raise APIError(
                400,
                "invalid_voice",
                "voice must be 1-64 characters of letters, digits, '_', '-' or '.'",
                param="voice",
            )
        return name
