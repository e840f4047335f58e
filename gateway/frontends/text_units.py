"""Cutting text that arrives in pieces into the units the streaming protocols speak.

A *unit* is one piece of text sent to the workers as one complete stream (one ``LlmSubmit``
without open text). The voice-agent protocols cut at sentence ends as the text arrives,
so that speech starts before the client's LLM has finished writing, and at a flush.
Because the gateway made the cut, it knows which text each frame of audio speaks: the
alignment estimate (``gateway.frontends.alignment``) and vLLM-Omni's ``sentence_index`` rest on it.

``Unit.raw`` is the text exactly as received, whitespace after the sentence included (the
character alignment of ElevenLabs clients must join up across units); ``Unit.text`` is
what is spoken (whitespace collapsed).
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from common.sentences import SentenceEnds

Granularity = Literal["none", "sentence", "clause"]

_WS = re.compile(r"\s+")
MIN_CLAUSE_CHARS = 12
"""A clause shorter than this waits for more (a lone "Yes," is not worth its own request)."""


class Unit(msgspec.Struct, frozen=True):
    raw: str
    text: str


def _unit(raw: str) -> Unit | None:
    text = _WS.sub(" ", raw).strip()
    return Unit(raw, text) if text else None


class UnitSplitter:
    """Incremental: ``feed`` returns the units complete so far, ``flush`` the rest.

    ``granularity`` "none" cuts only at ``flush`` (and at ``max_chars``).
    """

    def __init__(
        self,
        granularity: Granularity = "sentence",
        max_chars: int = 280,
        language: str | None = None,
    ) -> None:
        """``language``: whose abbreviations do not end a sentence (``common.sentences``);
        None: every language's."""
        self._granularity = granularity
        self._max_chars = max_chars
        self._finder = SentenceEnds(language, clauses=granularity == "clause")
        self._buffer = ""

    @property
    def pending(self) -> str:
        """Text received and not yet in a unit."""
        return self._buffer

    def _ends(self) -> list[int]:
        if self._granularity == "none":
            return []
        buf = self._buffer
        ends: list[int] = []
        for end in self._finder.find(buf):
            while end < len(buf) and buf[end].isspace():
                end += 1  # the whitespace after the end belongs to this unit
            ends.append(end)
        return ends

    def feed(self, text: str) -> list[Unit]:
        self._buffer += text
        out: list[Unit] = []
        start = 0
        for end in self._ends():
            if self._granularity == "clause" and end - start < MIN_CLAUSE_CHARS:
                continue
            if (u := _unit(self._buffer[start:end])) is not None:
                out.append(u)
            start = end
        self._buffer = self._buffer[start:]
        # Past max_chars without an end: cut at the last space that keeps the unit short.
        while len(self._buffer) > self._max_chars:
            cut = self._buffer.rfind(" ", 0, self._max_chars)
            cut = self._max_chars if cut <= 0 else cut + 1
            if (u := _unit(self._buffer[:cut])) is not None:
                out.append(u)
            self._buffer = self._buffer[cut:]
        return out

    def flush(self) -> list[Unit]:
        rest, self._buffer = self._buffer, ""
        u = _unit(rest)
        return [u] if u is not None else []
