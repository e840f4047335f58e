"""The languages of this checkpoint and of each voice: the one place that answers "what
language does this request speak" when the request does not say, and what the voice and
model listings show.

A request's language is, first found: the one it names (``language_code``, ``language``:
``resolve``), its voice's (``llm.voice_languages``, a LoRA voice's ``language``, the
``language`` a custom voice was made with; an OpenAI alias is its target's), the
checkpoint's main language (``llm.languages[0]``, which the orchestrator reads from the
model directory: ``llm_worker.model_info``), the server's ``text.language``.
"""

from __future__ import annotations

from collections.abc import Callable

from common.config import ServeConfig
from common.languages import UnknownLanguage, language_tag
from gateway.errors import APIError
from gateway.voices.catalogue import ENGLISH_VOICES


class VoiceLanguages:
    def __init__(
        self, config: ServeConfig, custom: Callable[[str], str | None] | None = None
    ) -> None:
        """``custom(voice id)``: a custom voice's language, None where it has none
        (``gateway.voices.custom.CustomVoices.language_of``)."""
        llm = config.llm
        self._custom = custom
        self._default_voice = llm.default_voice
        self._aliases = {k.lower(): v.lower() for k, v in config.gateway.voice_aliases.items()}
        self._model = {v.strip().lower() for v in (llm.voices or ENGLISH_VOICES)}
        """The checkpoint's voices: never custom ones, so no file is looked at for them."""
        default = language_tag(config.text.language)
        self.checkpoint: tuple[str, ...] = tuple(
            dict.fromkeys(language_tag(c) for c in (llm.languages or [default]))
        )
        """The languages the checkpoint speaks, its main one first."""
        self.default = self.checkpoint[0]
        self._voices = {v.strip().lower(): language_tag(c) for v, c in llm.voice_languages.items()}
        for name, lora in llm.lora_voices.items():
            if lora.language is not None:
                self._voices[name.strip().lower()] = language_tag(lora.language)

    def of_voice(self, voice: str | None) -> str:
        """The language of ``voice`` (any spelling of its name; None: the default voice),
        else the checkpoint's."""
        vid = (voice or self._default_voice).strip().lower()
        vid = self._aliases.get(vid, vid)
        found = self._voices.get(vid)
        if found is None and self._custom is not None and vid not in self._model:
            found = self._custom(vid)
        return found or self.default

    def all(self) -> tuple[str, ...]:
        """Every language this server's voices speak, the checkpoint's first."""
        return tuple(dict.fromkeys((*self.checkpoint, *self._voices.values())))

    def resolve(self, requested: str | None, voice: str | None, param: str = "language") -> str:
        """The language of a request that names ``requested`` (None or "": none) for
        ``voice`` (``"auto"``, vLLM-Omni's word for it, also names none): APIError 400
        ``invalid_language`` naming ``param`` for a code that names no language."""
        if requested and requested.strip().lower() != "auto":
            try:
                return language_tag(requested)
            except UnknownLanguage as e:
                raise APIError(400, "invalid_language", str(e), param=param) from None
        return self.of_voice(voice)
