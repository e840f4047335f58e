"""Cutting text that arrives in pieces into the units the streaming protocols speak.

A *unit* is one piece of text sent to the workers as one complete stream (one ``LlmSubmit``
without open text). The voice-agent protocols cut at sentence ends as the text arrives,
so that speech starts before the client's LLM has finished writing, and at a flush.
Because the gateway made the cut, it knows which text each frame of audio speaks: the
alignment estimate (``gateway.frontends.alignment``) and vLLM-Omni's ``sentence_index`` rest on it.

``Unit.raw`` is the text exactly as received, whitespace after the sentence included (the
character alignment of ElevenLabs clients must join up across units); ``Unit.text`` is
what is spoken (whitespace collapsed).

A break tag (``<break time="1s"/>``, ``gateway.text.breaks``) is a unit boundary too: the
text before it is cut into a unit, the tag is in neither unit's text (its characters are
not spoken and not aligned), and its pause is ``pause_ms`` of the next unit: silence spoken
before that unit's text (``gateway.frontends.utterance.speak_unit``). A pause with no text
after it comes out at ``flush`` as a unit of its own with no text. A tag split across two
pieces of text is held by the splitter's ``BreakScanner`` until its end arrives.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from common.sentences import SentenceEnds
from gateway.text.breaks import DEFAULT_MAX_MS, BreakScanner, Pause

Granularity = Literal["none", "sentence", "clause"]

_WS = re.compile(r"\s+")
MIN_CLAUSE_CHARS = 12
"""A clause shorter than this waits for more (a lone "Yes," is not worth its own request)."""


class Unit(msgspec.Struct, frozen=True):
    raw: str
    text: str
    pause_ms: int = 0
    """Silence before the text: the break tags between the previous unit and this one."""


class UnitSplitter:
    """Incremental: ``feed`` returns the units complete so far, ``flush`` the rest.

    ``granularity`` "none" cuts only at ``flush`` (and at ``max_chars``) and at break tags.
    ``feed`` and ``flush`` raise ``gateway.text.breaks.BreakError`` (400) for a malformed
    break tag or one longer than ``max_break_ms``; what came before it was returned by
    earlier calls, what follows it in the same piece is dropped.
    """

    def __init__(
        self,
        granularity: Granularity = "sentence",
        max_chars: int = 280,
        max_break_ms: int | None = DEFAULT_MAX_MS,
        *,
        language: str | None = None,
    ) -> None:
        """``max_break_ms``: the longest pause its break tags may write (None: checked by the
        caller); ``language``: whose abbreviations do not end a sentence
        (``common.sentences``); None: every language's."""
        self._granularity = granularity
        self._max_chars = max_chars
        self._finder = SentenceEnds(language, clauses=granularity == "clause")
        self._buffer = ""
        self._breaks = BreakScanner(max_break_ms)
        self._pause = 0
        """Silence of the breaks read since the last unit: the next unit's ``pause_ms``."""

    @property
    def pending(self) -> str:
        """Text received and not yet in a unit (a break tag not yet complete included)."""
        return self._buffer + self._breaks.held

    def _unit(self, raw: str) -> Unit | None:
        text = _WS.sub(" ", raw).strip()
        if not text:
            return None
        pause, self._pause = self._pause, 0
        return Unit(raw, text, pause)

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
        out: list[Unit] = []
        for piece in self._breaks.feed(text):
            if isinstance(piece, Pause):
                out += self._cut()
                self._pause += piece.ms
            else:
                out += self._feed_text(piece)
        return out

    def _feed_text(self, text: str) -> list[Unit]:
        self._buffer += text
        out: list[Unit] = []
        start = 0
        for end in self._ends():
            if self._granularity == "clause" and end - start < MIN_CLAUSE_CHARS:
                continue
            if (u := self._unit(self._buffer[start:end])) is not None:
                out.append(u)
            start = end
        self._buffer = self._buffer[start:]
        # Past max_chars without an end: cut at the last space that keeps the unit short.
        while len(self._buffer) > self._max_chars:
            cut = self._buffer.rfind(" ", 0, self._max_chars)
            cut = self._max_chars if cut <= 0 else cut + 1
            if (u := self._unit(self._buffer[:cut])) is not None:
                out.append(u)
            self._buffer = self._buffer[cut:]
        return out

    def _cut(self) -> list[Unit]:
        """Everything buffered as one unit (a flush, or a break tag)."""
        rest, self._buffer = self._buffer, ""
        u = self._unit(rest)
        return [u] if u is not None else []

    def flush(self) -> list[Unit]:
        out: list[Unit] = []
        for piece in self._breaks.flush():  # a held "<b" that never became a tag
            assert isinstance(piece, str)
            out += self._feed_text(piece)
        out += self._cut()
        if self._pause:  # breaks with no text after them: silence of their own
            out.append(Unit("", "", self._pause))
            self._pause = 0
        return out
