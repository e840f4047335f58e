"""vLLM-Omni's ``split_granularity``: the units a vLLM-Omni client is shown, over the units
the gateway speaks.

vLLM-Omni (``vllm_omni/entrypoints/openai/speech_text_splitter.py``) defines three values;
a *shown unit* is one ``audio.start`` ... ``audio.done`` pair, counted by ``sentence_index``
within one ``input.done`` flush:

- ``none`` (its default): the whole flush is one unit, its text stripped.
- ``sentence``: a unit ends after ``.``, ``!`` or ``?`` followed by whitespace (or at the
  flush), except a ``.`` between two digits (``3.50``), and at once after ``。 ！ ？ … । ॥ ؟``;
  the whitespace after an end belongs to the unit. No abbreviation list: ``"Mr. Smith"`` is
  two units there, so it is here.
- ``clause``: as ``sentence``, and also at once after ``, ; ， ； ،``.

The gateway still *speaks* smaller units (``gateway.frontends.text_units``: sentences of at most
``max_chars`` characters, each its own stream) so that speech can start before the flush,
but never across a shown unit's boundary: every spoken unit belongs to exactly one shown
unit, so each shown unit's audio is the audio of its spoken units in order. ``OmniUnits``
turns the client's text into both, as events in the order they happen: ``Speak`` (a spoken
unit of shown unit ``shown``, possibly before that unit's text is complete) and ``Close``
(shown unit ``shown`` is complete: its text is known and no ``Speak`` of it follows).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.frontends.text_units import Unit, UnitSplitter
from gateway.text.breaks import DEFAULT_MAX_MS, without_breaks

Granularity = Literal["none", "sentence", "clause"]

_LATIN = frozenset(".!?")
"""Abbreviation-prone ends: complete only when whitespace (or the flush) follows."""
_SCRIPT_SENTENCE = frozenset("。！？…।॥؟")
_SCRIPT_CLAUSE = _SCRIPT_SENTENCE | frozenset(",;，；،")


class Speak(msgspec.Struct, frozen=True):
    unit: Unit
    shown: int


class Close(msgspec.Struct, frozen=True):
    shown: int
    text: str


Event = Speak | Close


def unit_ends(buffer: str, granularity: Granularity, *, flush: bool) -> list[int]:
    """End offsets in ``buffer`` of the complete shown units (vLLM-Omni's rules); with
    ``flush`` the last one is ``len(buffer)``."""
    ends: list[int] = []
    if granularity != "none":
        script = _SCRIPT_CLAUSE if granularity == "clause" else _SCRIPT_SENTENCE
        n = len(buffer)
        i = 0
        while i < n:
            c = buffer[i]
            latin = c in _LATIN
            if not latin and c not in script:
                i += 1
                continue
            if c == "." and 0 < i < n - 1 and buffer[i - 1].isdigit() and buffer[i + 1].isdigit():
                i += 1  # a decimal point
                continue
            j = i + 1
            while j < n and buffer[j].isspace():
                j += 1
            if latin and j == i + 1 and not flush:
                i += 1  # "." with nothing after it yet: maybe "3.5", maybe "...", maybe the end
                continue
            ends.append(j)
            i = j
    if flush and (not ends or ends[-1] < len(buffer)):
        ends.append(len(buffer))
    return ends


class OmniUnits:
    """Incremental: ``feed`` and ``flush`` (one ``input.done``) return the events so far.

    ``max_chars`` bounds a spoken unit; ``max_shown_chars`` a shown one (a client that never
    flushes cannot make the gateway hold an unbounded unit: past it, the unit is closed at
    the last space, as ``UnitSplitter`` cuts). Shown indices restart at 0 after a flush.
    """

    def __init__(
        self,
        granularity: Granularity = "none",
        max_chars: int = 280,
        max_shown_chars: int = 4096,
        max_break_ms: int | None = DEFAULT_MAX_MS,
        language: str | None = None,
    ) -> None:
        self._granularity: Granularity = granularity
        self._max_chars = max_chars
        self._max_shown = max(max_shown_chars, 1)
        self._buf = ""
        """Text of the open shown unit."""
        self._fed = 0
        """How much of ``_buf`` the spoken-unit splitter has had."""
        self._spoken = UnitSplitter("sentence", max_chars, max_break_ms, language=language)
        """Cuts the spoken units, at break tags too (and holds a tag split across messages)."""
        self._index = 0

    @property
    def granularity(self) -> Granularity:
        return self._granularity

    @property
    def pending_chars(self) -> int:
        """Text received and not yet in a spoken unit (what a queue cap counts besides the
        queued units)."""
        return len(self._buf) - self._fed + len(self._spoken.pending)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._take(flush=False)

    def flush(self) -> list[Event]:
        events = self._take(flush=True)
        self._index = 0
        return events

    def _take(self, *, flush: bool) -> list[Event]:
        out: list[Event] = []
        consumed = 0
        for end in unit_ends(self._buf, self._granularity, flush=flush):
            self._close(end - consumed, out)
            consumed = end
        while len(self._buf) > self._max_shown:
            cut = self._buf.rfind(" ", 0, self._max_shown)
            cut = self._max_shown if cut <= 0 else cut + 1
            # Never before text the spoken units already have (it belongs to this unit).
            self._close(max(cut, self._fed), out)
        limit = self._safe_end()
        if limit > self._fed:
            for unit in self._spoken.feed(self._buf[self._fed : limit]):
                out.append(Speak(unit, self._index))
            self._fed = limit
        return out

    def _safe_end(self) -> int:
        """How much of the open unit's text surely belongs to it: all of it, except after a
        ``.``/``!``/``?`` followed by other than whitespace (``e.g.``, ``Hi.there``), which
        vLLM-Omni ends a unit at if the flush comes first."""
        if self._granularity == "none":
            return len(self._buf)
        buf = self._buf
        for i in range(len(buf) - 1):
            if buf[i] in _LATIN and not buf[i + 1].isspace():
                if not (buf[i] == "." and i > 0 and buf[i - 1].isdigit() and buf[i + 1].isdigit()):
                    return i + 1
        return len(buf)

    def _close(self, end: int, out: list[Event]) -> None:
        """Close the open shown unit, whose complete text is ``_buf[:end]``."""
        piece, self._buf = self._buf[:end], self._buf[end:]
        for unit in self._spoken.feed(piece[self._fed :]) + self._spoken.flush():
            out.append(Speak(unit, self._index))
        self._fed = 0
        if text := without_breaks(piece).strip():
            out.append(Close(self._index, text))
            self._index += 1
