"""The languages of this checkpoint and of each voice: the one place that answers "what
language does this request speak" when the request does not say, and what the voice and
model listings show.

A request's language is, first found: the one it names (``language_code``, ``language``:
``resolve``), its voice's (``llm.voice_languages``, a LoRA voice's ``language``), the
checkpoint's main language (``llm.languages[0]``, which the orchestrator reads from the
model directory: ``llm_worker.model_info``), the server's ``text.language``.
"""

from __future__ import annotations

from common.config import ServeConfig
from common.languages import UnknownLanguage, language_tag
from gateway.errors import APIError


class VoiceLanguages:
    def __init__(self, config: ServeConfig) -> None:
        llm = config.llm
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
        """The language of ``voice`` (any spelling of its name), else the checkpoint's."""
        if voice is None:
            return self.default
        return self._voices.get(voice.strip().lower(), self.default)

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
