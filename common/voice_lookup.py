"""Which voice a name is (the model's, a LoRA voice, a custom voice), in one order and with
one message for each refusal: the gateway looks a voice up before admission and the
llm_worker again when the stream starts (a ZeroMQ client that bypasses a gateway, a voice
deleted meanwhile), so both answer alike. The other rule both check is ``limits``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

from store.voices import ID_RE

VoiceKind = Literal["model", "lora", "custom"]


def unknown_voice(voice: str, model_voices: Iterable[str]) -> str:
    """The message of a voice this server does not have (a 400, ``bad_request``)."""
    return (
        f"unknown voice {voice!r}; voices: {', '.join(model_voices)} "
        "(and the custom voices listed by GET /v1/audio/voices)"
    )


def lora_unavailable(vid: str, reason: str) -> str:
    """The message of a LoRA voice whose entry the llm_worker could not load (at start or
    when it synced the registry; a 503, ``voice_unavailable``; ``LoraRegistry.failure`` is ``reason``)."""
    return (
        f"LoRA voice {vid!r} failed to load in the llm worker: {reason}; "
        "load it again with POST /v1/admin/lora (or remove it with DELETE /v1/admin/lora/"
        f"{vid})"
    )


def zero_shot_unsupported(vid: str) -> str:
    """The message of a custom voice named while the model takes none (a 400)."""
    return (
        f"voice {vid!r} is a custom (zero-shot) voice, and this model does not declare "
        "zero-shot support (config.json 'orpheus.zero_shot'; [llm] zero_shot)"
    )


class VoiceLookup:
    """Which kind of voice a name is, in the one order both the gateway (before admission)
    and the llm_worker (when the stream starts) look it up:

    1. a voice of the model (``llm.voices`` / the checkpoint's, stripped, lower case): no
       file is touched, so the common request costs nothing here;
    2. a LoRA voice (``[llm] lora_voices``, or loaded at run time: ``LoraRegistry``);
    3. a custom (zero-shot) voice (``VoiceStore``).

    Names are looked up as voices are matched: stripped, lower case (aliases are the
    gateway's and are resolved before). A LoRA voice and a custom voice never share a name
    with a model voice (the configuration's check, and the create/load handlers refuse
    taken names); where a custom voice and a LoRA voice do share one (a LoRA configured
    after the voice was made), the LoRA voice wins.

    ``is_lora`` and ``is_custom`` are each process's own view (the gateway's: files in the
    state directory; the worker's: the adapters it loaded and the store)."""

    def __init__(
        self,
        model_voices: Iterable[str],
        is_lora: Callable[[str], bool] | None = None,
        is_custom: Callable[[str], bool] | None = None,
    ) -> None:
        self.model_voices = tuple(dict.fromkeys(v.strip().lower() for v in model_voices))
        self._model = frozenset(self.model_voices)
        self._is_lora = is_lora
        self._is_custom = is_custom

    def kind(self, voice: str) -> VoiceKind | None:
        """The kind of voice ``voice`` is; None: this server has no such voice."""
        key = voice.strip().lower()
        if key in self._model:
            return "model"
        if not ID_RE.match(key):
            return None
        if self._is_lora is not None and self._is_lora(key):
            return "lora"
        if self._is_custom is not None and self._is_custom(key):
            return "custom"
        return None

    def unknown(self, voice: str) -> str:
        """The message for ``voice`` when ``kind`` found nothing."""
        return unknown_voice(voice, self.model_voices)
