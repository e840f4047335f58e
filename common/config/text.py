"""The ``[text]`` section: what the gateway does to a request's text before the model reads
it (``gateway.text``): normalisation and pronunciation dictionaries."""

from __future__ import annotations

from typing import Literal

import msgspec


class TextConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    normalization: Literal["on", "off"] = "on"
    """What ``apply_text_normalization: "auto"`` (and a request that sets none) means:
    ``on`` writes numbers, dates, times, currency, units, abbreviations, URLs and e-mail
    addresses as words in the request's language before the model reads them (docs/api.md
    lists the languages; text in one with no normaliser is spoken as sent); ``off`` leaves
    the text as sent."""
    language: str = "en"
    """The language (ISO 639-1) of a request that names none, for a voice and a checkpoint
    that declare none (``llm.languages``, ``llm.voice_languages``)."""
    pronunciation_dictionaries: list[str] = []
    """Server-wide default dictionaries, applied to every request after its own locators:
    ``"ID"`` (its latest version, looked up per request) or ``"ID:VERSION_ID"``. A default
    that does not exist makes every request fail with 400 naming it."""
    max_dictionaries: int = 1000
    """Most pronunciation dictionaries the state directory holds (``voices.state_dir``)."""
    max_dictionary_rules: int = 1000
    """Most rules one dictionary version holds."""
    max_dictionary_versions: int = 16
    """Versions kept per dictionary; a change past it drops the oldest (a locator naming a
    dropped version gets 404)."""
    max_pls_bytes: int = 1 << 20
    """Largest PLS file ``add-from-file`` accepts."""
