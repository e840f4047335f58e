"""Pauses written in the text: ElevenLabs' ``<break time="1.5s" />`` and SSML's ``strength``.

A break tag is never model text: the text is cut at it into runs, and the pause between
two runs is silence of its length, made by the gateway (``gateway.frontends.utterance``
between the units of the streaming protocols, ``gateway.requests`` between the runs of one
request). Only ``<break>`` is read here; every other angle-bracketed word is left in the
text as it is (Orpheus' emotion tags, ``<laugh>``, are such words).

Accepted: ``<break time="1.5s"/>``, ``time="500ms"`` (integer or decimal, ``s`` or ``ms``,
single or double quotes, with or without the ``/``), ``strength="..."`` with the durations
below (``time`` wins when both are given, as in SSML), and a bare ``<break/>`` (SSML's
default, ``medium``). Anything else that starts with ``<break`` is malformed: an unknown
attribute or value, a tag without its ``>``. A pause longer than the cap (``gateway.max_break_s``,
3 s as ElevenLabs) is refused, never shortened; tags at one place (nothing but whitespace
between them) make one pause, under the same cap.

``split_breaks`` reads a whole text; ``BreakScanner`` reads text that arrives in pieces
(the WebSocket protocols' messages), holding back a tag that is not complete yet: that
held fragment (``BreakScanner.held``) is the only text this module keeps between pieces.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from gateway.errors import APIError

STRENGTH_MS: dict[str, int] = {
    "none": 0,
    "x-weak": 250,
    "weak": 500,
    "medium": 750,
    "strong": 1000,
    "x-strong": 1250,
}
"""SSML's ``strength`` values as Azure's speech service documents them."""
DEFAULT_MS = STRENGTH_MS["medium"]
"""A ``<break/>`` without attributes: SSML's default strength."""
DEFAULT_MAX_MS = 3000
"""``gateway.max_break_s``'s default, in ms (ElevenLabs' limit)."""
MAX_TAG_CHARS = 128
"""A tag longer than this (from ``<`` to ``>``) is malformed: a fragment held between
messages never grows past it."""
_PREFIX = "<break"
_START = re.compile(r"<break(?=[\s/>])", re.IGNORECASE)
_ATTR = re.compile(r"""\s*([A-Za-z_:][-A-Za-z0-9_:.]*)\s*=\s*(?:"([^"]*)"|'([^']*)')""")
_TIME = re.compile(r"\s*(\d{1,6}(?:\.\d{1,6})?)\s*(ms|s)\s*", re.IGNORECASE)


class Pause(msgspec.Struct, frozen=True):
    """Silence of ``ms`` milliseconds at its place in the text."""

    ms: int


Piece = str | Pause


class BreakError(APIError):
    """A ``<break>`` tag this server does not take (malformed, or over the cap): 400."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(400, code, message, param=param)


def _malformed(tag: str, why: str) -> BreakError:
    shown = tag if len(tag) <= 60 else tag[:57] + "..."
    return BreakError(
        "invalid_break",
        f'malformed break tag {shown!r}: {why}; write <break time="1.5s" /> (or "500ms") '
        f'or <break strength="medium" /> ({", ".join(STRENGTH_MS)})',
    )


def parse_tag(tag: str, max_ms: int | None) -> Pause:
    """The pause of one complete tag ``<break ...>`` (``max_ms`` None: no cap)."""
    body = tag[len(_PREFIX) : -1]
    if body.endswith("/"):
        body = body[:-1]
    attrs: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        m = _ATTR.match(body, pos)
        if m is None:
            if body[pos:].strip():
                raise _malformed(tag, 'attributes are name="value" pairs')
            break
        name = m.group(1).lower()
        if name in attrs:
            raise _malformed(tag, f"{name} is given twice")
        attrs[name] = m.group(2) if m.group(2) is not None else m.group(3)
        pos = m.end()
    unknown = set(attrs) - {"time", "strength"}
    if unknown:
        raise _malformed(tag, f"unknown attribute {sorted(unknown)[0]!r}")
    if "time" in attrs:
        t = _TIME.fullmatch(attrs["time"])
        if t is None:
            raise _malformed(tag, f"time={attrs['time']!r} is not a duration like 1.5s or 500ms")
        value = float(t.group(1))
        ms = round(value * (1 if t.group(2).lower() == "ms" else 1000))
    elif "strength" in attrs:
        strength = attrs["strength"].strip().lower()
        if strength not in STRENGTH_MS:
            raise _malformed(tag, f"strength={attrs['strength']!r} is not an SSML strength")
        ms = STRENGTH_MS[strength]
    else:
        ms = DEFAULT_MS
    if max_ms is not None and ms > max_ms:
        raise BreakError(
            "break_too_long",
            f"a break of {ms} ms is longer than this server's limit of {max_ms} ms "
            "(gateway.max_break_s)",
        )
    return Pause(ms)


def _tag_end(text: str, start: int) -> int:
    """The index just past the ``>`` of the tag at ``start``, or -1 if it has none yet;
    ``BreakError`` if no ``>`` comes within ``MAX_TAG_CHARS`` or another ``<`` comes first."""
    for i in range(start + len(_PREFIX), min(len(text), start + MAX_TAG_CHARS)):
        c = text[i]
        if c == ">":
            return i + 1
        if c == "<":
            raise _malformed(text[start:i], "it has no closing >")
    if len(text) - start >= MAX_TAG_CHARS:
        raise _malformed(text[start : start + MAX_TAG_CHARS], "it has no closing >")
    return -1


def _add(out: list[Piece], piece: Piece) -> None:
    if isinstance(piece, str):
        if not piece:
            return
        if out and isinstance(out[-1], str):
            out[-1] += piece
            return
    out.append(piece)


def split_breaks(text: str, max_ms: int | None) -> list[Piece]:
    """``text`` cut at its break tags: runs of text and ``Pause``s, in order (no empty run).
    ``BreakError`` for a malformed tag or one over ``max_ms`` (None: no cap)."""
    if "<" not in text:
        return [text] if text else []
    scanner = BreakScanner(max_ms)
    out = scanner.feed(text)
    for piece in scanner.flush():
        _add(out, piece)
    return out


def cap_ms(max_break_s: float) -> int:
    """``gateway.max_break_s`` in whole milliseconds."""
    return round(max_break_s * 1000)


def has_breaks(text: str) -> bool:
    return "<" in text and _START.search(text) is not None


def check_breaks(text: str, max_ms: int | None, param: str = "input") -> bool:
    """Refuse (``BreakError``, naming ``param``) a whole text with a tag this server does not
    take. True: the text has words besides its tags."""
    if "<" not in text:
        return bool(text.strip())
    try:
        pieces = split_breaks(text, max_ms)
    except BreakError as e:
        e.param = param
        raise
    return any(isinstance(p, str) and p.strip() for p in pieces)


def without_breaks(text: str) -> str:
    """``text`` with its break tags taken out (for text shown to a client; a text that
    ``split_breaks`` refuses is returned as it is: its error is raised where it is spoken)."""
    if not has_breaks(text):
        return text
    try:
        return "".join(p for p in split_breaks(text, None) if isinstance(p, str))
    except BreakError:
        return text


def join_breaks(pieces: list[Piece]) -> str:
    """Pieces back into text, each pause as ``<break time="Nms"/>`` (what ``split_breaks``
    reads back to the same pieces)."""
    return "".join(p if isinstance(p, str) else f'<break time="{p.ms}ms"/>' for p in pieces)


def rewrite_runs(text: str, rewrite: Callable[[str], str]) -> str:
    """``text`` with ``rewrite`` (a ``str -> str``) applied to each run between its break
    tags, the tags kept (as ``join_breaks`` writes them)."""
    if not has_breaks(text):
        return rewrite(text)
    return join_breaks([rewrite(p) if isinstance(p, str) else p for p in split_breaks(text, None)])


class BreakScanner:
    """Break tags in text that arrives in pieces: ``feed`` returns the runs and pauses that
    are complete, holding back a tag not closed yet (``held``); ``flush`` ends the input."""

    __slots__ = ("_held", "_max_ms", "_place_ms")

    def __init__(self, max_ms: int | None) -> None:
        self._max_ms = max_ms
        self._held = ""
        self._place_ms = 0
        """The pauses since the last words: tags at one place add up, to the cap at most."""

    def _emit(self, out: list[Piece], piece: Piece) -> None:
        if isinstance(piece, Pause):
            self._place_ms += piece.ms
            if self._max_ms is not None and self._place_ms > self._max_ms:
                raise BreakError(
                    "break_too_long",
                    f"the break tags at one place add up to a pause of {self._place_ms} ms, "
                    f"longer than this server's limit of {self._max_ms} ms (gateway.max_break_s)",
                )
        elif piece.strip():
            self._place_ms = 0
        _add(out, piece)

    @property
    def held(self) -> str:
        """Text held back: the start of a break tag whose end has not arrived (at most
        ``MAX_TAG_CHARS``; the caller counts it against its limits)."""
        return self._held

    def feed(self, text: str) -> list[Piece]:
        buf = self._held + text if self._held else text
        self._held = ""
        out: list[Piece] = []
        pos = 0
        while True:
            lt = buf.find("<", pos)
            if lt < 0:
                self._emit(out, buf[pos:])
                return out
            rest = buf[lt : lt + len(_PREFIX) + 1]
            if _START.match(buf, lt):
                end = _tag_end(buf, lt)
                if end < 0:  # the tag continues in a later piece
                    self._emit(out, buf[pos:lt])
                    self._held = buf[lt:]
                    return out
                self._emit(out, buf[pos:lt])
                self._emit(out, parse_tag(buf[lt:end], self._max_ms))
                pos = end
            elif len(rest) <= len(_PREFIX) and _PREFIX.startswith(rest.lower()):
                # "<", "<b", ... "<break" at the end: a tag may be starting
                self._emit(out, buf[pos:lt])
                self._held = buf[lt:]
                return out
            else:
                self._emit(out, buf[pos : lt + 1])
                pos = lt + 1

    def flush(self) -> list[Piece]:
        """The end of the input: a held ``<break`` that never closed is malformed; a held
        ``<b`` that never became a tag is text."""
        held, self._held = self._held, ""
        if _START.match(held):
            raise _malformed(held, "it has no closing >")
        return [held] if held else []
