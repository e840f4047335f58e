"""What the checkpoint says about itself: its voices and emotion tags.

Voices belong to the model's configuration (docs/orpheus.md): English checkpoints know
tara, leah, ...; the multilingual research checkpoints know others. They are read from the
``"orpheus"`` table of the checkpoint's ``config.json``::

    "orpheus": {"voices": ["tara", "leah", ...], "emotion_tags": ["laugh", ...],
                "zero_shot": true}

``zero_shot`` declares that the checkpoint continues a previous turn's voice (the pretrained
Orpheus checkpoints do; a fine-tune on named speakers may not): custom voices made from
reference audio are served only then (``[llm] zero_shot`` overrides it).

(``orpheus-serve tiny-model`` writes it; for a published checkpoint that lacks it, set
``[llm] voices`` or accept the English set). This module is import-light (json, msgspec):
any process may use it to list voices.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import msgspec

from common.llm_config import LLMConfig

log = logging.getLogger(__name__)

ENGLISH_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
"""Voices of canopylabs/orpheus-3b-0.1-ft, best first."""
EMOTION_TAGS = ("laugh", "chuckle", "sigh", "cough", "sniffle", "groan", "yawn", "gasp")


class ModelInfo(msgspec.Struct, frozen=True):
    voices: tuple[str, ...]
    emotion_tags: tuple[str, ...]
    source: str
    """Where the voices came from: "config" (llm.voices), a file path, or "default"."""
    zero_shot: bool = False
    """Whether the checkpoint declares zero-shot voices (config.json ``orpheus.zero_shot``)."""


def find_model_file(model: str, filename: str) -> Path | None:
    """``filename`` of a local checkpoint directory, or of a hub checkpoint already in the
    local cache (never downloads)."""
    local = Path(model) / filename
    if local.is_file():
        return local
    if os.path.isdir(model):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(model, filename)
    return Path(cached) if isinstance(cached, str) else None


def load_model_info(config: LLMConfig) -> ModelInfo:
    """Voices and emotion tags for ``config.model``; ``config.voices`` overrides the file."""
    table: dict = {}
    source = "default"
    path = find_model_file(config.model, "config.json")
    if path is not None:
        try:
            table = json.loads(path.read_text()).get("orpheus") or {}
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the model configuration {path}: {e}") from e
        if table.get("voices"):
            source = str(path)
    if config.voices is not None:
        voices, source = tuple(config.voices), "config"
    else:
        voices = tuple(table.get("voices") or ENGLISH_VOICES)
    tags = tuple(table.get("emotion_tags") or EMOTION_TAGS)
    voices = tuple(v.strip().lower() for v in voices)
    if not voices or any(not v for v in voices):
        raise ValueError(f"the voice list of {config.model} is empty or has an empty name")
    if config.default_voice.lower() not in voices:
        raise ValueError(
            f"default_voice {config.default_voice!r} is not one of the model's voices {voices}"
        )
    zero_shot = (
        bool(table.get("zero_shot", False)) if config.zero_shot is None else config.zero_shot
    )
    return ModelInfo(voices=voices, emotion_tags=tags, source=source, zero_shot=zero_shot)
