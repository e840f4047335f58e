"""Voice names: OpenAI aliases mapped to model voices, and the check that a voice exists.

A request's voice is resolved and checked here, before admission (``gateway.schemas``): its
*shape* (nothing but a plain identifier may reach the prompt ``"{voice}: {text}"``), an
alias to its model voice, then that the voice is one the llm_worker takes, looked up by
``common.voice_lookup.VoiceLookup``: a voice of the model (``llm.voices``, resolved once by the
orchestrator from the model's configuration), a LoRA voice, a custom voice (``is_lora`` and
``is_custom``: ``CustomVoices``'). The llm_worker makes the same decision again, with the same
lookup and the same message, when the stream starts (a voice deleted in between is its 400).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from common.voice_lookup import VoiceLookup
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
    def __init__(
        self,
        aliases: dict[str, str],
        model_voices: list[str],
        default: str,
        is_lora: Callable[[str], bool] | None = None,
        is_custom: Callable[[str], bool] | None = None,
    ) -> None:
        """``is_lora(voice)``, ``is_custom(voice)``: whether a voice that is not the model's
        (lower case) is a LoRA or a custom voice; either may raise ``APIError`` for one that
        exists and cannot be used."""
        self._aliases = {k.lower(): v for k, v in aliases.items()}
        self.model_voices = list(model_voices)
        self.lookup = VoiceLookup(model_voices, is_lora, is_custom)
        self.default = default
        self.listing = VoiceList(voices=self.model_voices, aliases=dict(aliases), default=default)

    def resolve(self, name: str) -> str:
        """The voice for ``name`` (an alias target, or ``name`` itself), checked: APIError 400
        ``invalid_voice`` for a name that cannot be one, ``bad_request`` for a voice that
        this server does not have (the llm_worker's code and message for it), or what
        ``is_lora`` / ``is_custom`` raise for one it has and cannot use (503
        ``voice_unavailable``: a LoRA voice an llm_worker failed to load)."""
        voice = self._aliases.get(name.lower())
        if voice is None:
            if not _VOICE_RE.match(name):
                raise APIError(
                    400,
                    "invalid_voice",
                    "voice must be 1-64 characters of letters, digits, '_', '-' or '.'",
                    param="voice",
                )
            voice = name
        if self.lookup.kind(voice) is None:
            raise APIError(400, "bad_request", self.lookup.unknown(voice), param="voice")
        return voice
