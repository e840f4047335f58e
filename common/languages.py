"""Language codes: what a request, a voice, a checkpoint or a dictionary may name.

A language is named by its ISO 639-1 code (``fr``), optionally with a region or script
subtag as BCP 47 writes them (``fr-CA``, ``zh-Hans``, ``pt_BR``): the server speaks per
language, never per region, so ``language_tag`` keeps the primary subtag, lower case. The
three-letter codes ElevenLabs and some checkpoints' model cards use for a few languages
(``fra``, ``cmn``, ``hin``), and the English names vLLM-Omni's clients send (``"French"``,
``"Chinese"``), are accepted for the languages the server normalises.

Import-light (re only): the gateway, the orchestrator and the llm worker all read it.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_LANGUAGE", "ISO_639_1", "SPACELESS", "UnknownLanguage", "language_tag"]

DEFAULT_LANGUAGE = "en"

SPACELESS = frozenset({"zh", "ja", "th", "lo", "km", "my"})
"""Languages written without spaces between words (a "word" there is a sentence)."""

ISO_639_1 = frozenset(
    """
    aa ab ae af ak am an ar as av ay az ba be bg bi bm bn bo br bs ca ce ch co cr cs cu cv
    cy da de dv dz ee el en eo es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho
    hr ht hu hy hz ia id ie ig ii ik io is it iu ja jv ka kg ki kj kk kl km kn ko kr ks ku
    kv kw ky la lb lg li ln lo lt lu lv mg mh mi mk ml mn mr ms mt my na nb nd ne ng nl nn
    no nr nv ny oc oj om or os pa pi pl ps pt qu rm rn ro ru rw sa sc sd se sg si sk sl sm
    sn so sq sr ss st su sv sw ta te tg th ti tk tl tn to tr ts tt tw ty ug uk ur uz ve vi
    vo wa wo xh yi yo za zh zu
    """.split()
)
"""Every ISO 639-1 code."""

_THREE_LETTER = {
    "eng": "en", "fra": "fr", "fre": "fr", "deu": "de", "ger": "de", "spa": "es",
    "ita": "it", "por": "pt", "nld": "nl", "dut": "nl", "kor": "ko", "jpn": "ja",
    "hin": "hi", "zho": "zh", "chi": "zh", "cmn": "zh", "rus": "ru", "pol": "pl",
    "tur": "tr",
}  # fmt: skip

_NAMES = {
    "english": "en", "french": "fr", "german": "de", "spanish": "es", "italian": "it",
    "portuguese": "pt", "dutch": "nl", "korean": "ko", "japanese": "ja", "hindi": "hi",
    "chinese": "zh", "mandarin": "zh", "russian": "ru", "polish": "pl", "turkish": "tr",
}  # fmt: skip

DISPLAY_NAMES = {code: name.capitalize() for name, code in reversed(_NAMES.items())}
"""English names of the codes (the listings' ``name``; ``zh``: Chinese)."""


def language_name(code: str) -> str:
    """A language's English name for a listing (its code where it has none here)."""
    return DISPLAY_NAMES.get(code.split("-")[0], code)


_TAG = re.compile(r"^([A-Za-z]{2,3})(?:[-_][A-Za-z0-9]{1,8})*$")


class UnknownLanguage(ValueError):
    """A code that names no language: its message says what was sent and what is taken."""


def language_tag(code: str) -> str:
    """The ISO 639-1 code of ``code`` (``"fr-CA"`` -> ``"fr"``, ``"cmn"`` -> ``"zh"``);
    ``UnknownLanguage`` for anything else."""
    name = _NAMES.get(code.strip().lower())
    if name is not None:
        return name
    m = _TAG.match(code.strip())
    if m is not None:
        primary = m.group(1).lower()
        if primary in ISO_639_1:
            return primary
        if primary in _THREE_LETTER:
            return _THREE_LETTER[primary]
    raise UnknownLanguage(
        f"unknown language {code!r}: an ISO 639-1 code such as 'en', 'fr' or 'zh' "
        "(a region or script subtag such as 'fr-CA' is taken and ignored)"
    )
