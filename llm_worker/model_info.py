"""What the checkpoint says about itself: its voices, languages and emotion tags.

Voices belong to the model's configuration (docs/orpheus.md): English checkpoints know
tara, leah, ...; the multilingual research checkpoints know others. They are read from the
``"orpheus"`` table of the checkpoint's ``config.json``::

    "orpheus": {"voices": ["tara", "leah", ...], "emotion_tags": ["laugh", ...],
                "zero_shot": true}

``zero_shot`` declares that the checkpoint continues a previous turn's voice (the pretrained
Orpheus checkpoints do; a fine-tune on named speakers may not): custom voices made from
reference audio are served only then (``[llm] zero_shot`` overrides it).

Languages: ``"voices"`` may map each voice to its language (``{"pierre": "fr", "jana":
"de"}``), and ``"languages"`` (or ``"language"``) names the checkpoint's. Without them, the
``language:`` of the checkpoint's model card (the front matter of its README.md, which
every Hugging Face checkpoint has) names them. Canopy Labs' multilingual research
checkpoints ship no voice list: for a checkpoint whose card names one of their languages
and that declares no voices, their voices are known (``CANOPY_VOICES``), so ``--model DIR``
needs no ``[llm] voices`` by hand.

(``orpheus-serve tiny-model`` writes it; for a published checkpoint that lacks it, set
``[llm] voices`` or accept the English set). This module is import-light (json, msgspec):
any process may use it to list voices.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import msgspec

from common.config.llm import LLMConfig
from common.languages import UnknownLanguage, language_tag

log = logging.getLogger(__name__)

ENGLISH_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
"""Voices of canopylabs/orpheus-3b-0.1-ft, best first."""
EMOTION_TAGS = ("laugh", "chuckle", "sigh", "cough", "sniffle", "groan", "yawn", "gasp")
CANOPY_VOICES = {
    "fr": ("pierre", "amelie", "marie"),
    "de": ("jana", "thomas", "max"),
    "es": ("javi", "sergio", "maria"),
    "it": ("pietro", "giulia", "carlo"),
}
"""The voices of Canopy Labs' multilingual research checkpoints (French; German; Spanish and
Italian, one checkpoint), by language. Their Korean, Hindi and Mandarin voices are named in
their own scripts, which a voice name here cannot be (``store.voices.ID_RE``): not listed."""
_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---", re.S)
_CARD_LANGUAGE = re.compile(r"^language:[ \t]*(\S.*)?$((?:\n[ \t]*-[ \t]*\S+)*)", re.M)


class ModelInfo(msgspec.Struct, frozen=True):
    voices: tuple[str, ...]
    emotion_tags: tuple[str, ...]
    source: str
    """Where the voices came from: "config" (llm.voices), a file path, or "default"."""
    zero_shot: bool = False
    """Whether the checkpoint declares zero-shot voices (config.json ``orpheus.zero_shot``)."""
    languages: tuple[str, ...] = ()
    """The checkpoint's languages (ISO 639-1), its main one first; () where nothing says."""
    voice_languages: dict[str, str] = {}
    """Voice -> its language, where the checkpoint (or ``llm.voice_languages``) says."""
    default_voice: str = "tara"


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


def card_languages(model: str) -> tuple[str, ...]:
    """The ``language:`` of the checkpoint's model card (README.md front matter: one code or
    a list), as ISO 639-1 codes; () where there is none (codes that name no language are
    skipped: a card is not this server's to refuse)."""
    path = find_model_file(model, "README.md")
    if path is None:
        return ()
    try:
        head = path.read_text(errors="replace")[:16384]
    except OSError:
        return ()
    fm = _FRONT_MATTER.match(head)
    m = _CARD_LANGUAGE.search(fm.group(1)) if fm else None
    if m is None:
        return ()
    raw = [m.group(1) or ""] + [x.strip().lstrip("-").strip() for x in m.group(2).splitlines()]
    return _tags(c.strip().strip("[]\"'") for r in raw for c in r.split(",") if c.strip())


def _tags(codes: Iterable[object]) -> tuple[str, ...]:
    out = []
    for c in codes:
        try:
            out.append(language_tag(str(c)))
        except UnknownLanguage:
            continue
    return tuple(dict.fromkeys(out))


def load_model_info(config: LLMConfig) -> ModelInfo:
    """Voices, languages and emotion tags for ``config.model``; ``config.voices``,
    ``config.languages`` and ``config.voice_languages`` override the files."""
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
    declared = table.get("voices") or ()
    voice_languages: dict[str, str] = {}
    if isinstance(declared, dict):
        voice_languages = {
            str(v).strip().lower(): language_tag(str(c)) for v, c in declared.items()
        }
    listed = table.get("languages") or ([table["language"]] if table.get("language") else [])
    languages = _tags(listed)
    if not languages:
        languages = card_languages(config.model)
    if not declared and config.voices is None:
        canopy = tuple(v for lang in languages for v in CANOPY_VOICES.get(lang, ()))
        if canopy:
            declared, source = canopy, "canopy"
            voice_languages = {v: lang for lang in languages for v in CANOPY_VOICES.get(lang, ())}
    if config.voices is not None:
        voices, source = tuple(config.voices), "config"
    else:
        voices = tuple(declared or ENGLISH_VOICES)
    if config.languages is not None:
        languages = _tags(config.languages)
    if not languages:
        languages = tuple(dict.fromkeys(voice_languages.values()))
    voice_languages.update(
        {v.strip().lower(): language_tag(c) for v, c in config.voice_languages.items()}
    )
    tags = tuple(table.get("emotion_tags") or EMOTION_TAGS)
    voices = tuple(v.strip().lower() for v in voices)
    if not voices or any(not v for v in voices):
        raise ValueError(f"the voice list of {config.model} is empty or has an empty name")
    default_voice = config.default_voice.lower()
    if default_voice not in voices:
        if source == "config" or default_voice != LLMConfig().default_voice:
            raise ValueError(
                f"default_voice {config.default_voice!r} is not one of the model's voices {voices}"
            )
        default_voice = voices[0]  # the checkpoint's own voices, and no default was named
    zero_shot = (
        bool(table.get("zero_shot", False)) if config.zero_shot is None else config.zero_shot
    )
    return ModelInfo(
        voices=voices, emotion_tags=tags, source=source, zero_shot=zero_shot,
        languages=languages, voice_languages=voice_languages, default_voice=default_voice,
    )  # fmt: skip
