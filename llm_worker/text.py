"""Splitting text into pieces the model speaks well: whole sentences, at most N characters.

Orpheus degrades (and loops) on long inputs, so long text is generated piece by piece, in
order, as one continuous stream. Pieces end at sentence boundaries where possible, then at
clause boundaries, then at spaces; a single word longer than the limit is cut.

Two entry points:

- :func:`split_text` for text known in full: sentences are packed greedily into pieces of
  at most ``max_chars`` characters (fewer pieces, fewer prompt prefills).
- :class:`TextStream` for text that arrives in parts (``LlmAppendText``): each sentence is
  released as soon as it is complete, so speech can start before the text ends.
"""

from __future__ import annotations

import re

from common.sentences import SentenceEnds, joins_tight

# Sentence ends are ``common.sentences``' (the gateway's units end at the same places), for
# every language's abbreviations (the worker is not told the language; a "." wrongly taken
# for an abbreviation's only joins two sentences into one piece), and at line breaks.
_SENTENCE_ENDS = SentenceEnds(None)
_LINE_BREAKS = re.compile(r"\n+")
_CLAUSE_END = re.compile(r"""[,;:—–]["'”’)\]]*(?=\s)|[，、；：]["'”’）」』]*""")
_SPACES = re.compile(r"\s+")
_TAG = re.compile(r"<\s*([A-Za-z]+)\s*>")


def normalise_tags(text: str, tags: frozenset[str]) -> str:
    """Write the model's emotion tags the way it was trained on them (``< Laugh >`` ->
    ``<laugh>``); other angle-bracketed words are left as they are (plain text)."""

    def fix(m: re.Match[str]) -> str:
        name = m.group(1).lower()
        return f"<{name}>" if name in tags else m.group(0)

    return _TAG.sub(fix, text)


def _normalise(text: str) -> str:
    return _SPACES.sub(" ", text).strip()


def _sentence_ends(text: str) -> list[int]:
    """Offsets just past each sentence end found in ``text``."""
    ends = _SENTENCE_ENDS.find(text)
    if "\n" in text:
        ends = sorted({*ends, *(m.end() for m in _LINE_BREAKS.finditer(text))})
    return ends


def sentences(text: str) -> list[str]:
    """The sentences of ``text``, whitespace-normalised, empty ones dropped."""
    out, start = [], 0
    for end in [*_sentence_ends(text), len(text)]:
        piece = _normalise(text[start:end])
        if piece:
            out.append(piece)
        start = end
    return out


def _split_long(sentence: str, max_chars: int) -> list[str]:
    """Split one over-long sentence at clause boundaries, then spaces, then hard."""
    if len(sentence) <= max_chars:
        return [sentence]
    clauses, start = [], 0
    for m in _CLAUSE_END.finditer(sentence):
        clauses.append(sentence[start : m.end()].strip())
        start = m.end()
    clauses.append(sentence[start:].strip())
    if len(clauses) > 1:
        return _pack([p for c in clauses if c for p in _split_long(c, max_chars)], max_chars)
    words = sentence.split(" ")
    if len(words) > 1:
        return _pack([p for w in words for p in _split_long(w, max_chars)], max_chars)
    return [sentence[i : i + max_chars] for i in range(0, len(sentence), max_chars)]


def _pack(parts: list[str], max_chars: int) -> list[str]:
    """Join consecutive parts with spaces (none between CJK text) into pieces of at most
    ``max_chars``."""
    out: list[str] = []
    for part in parts:
        sep = "" if out and joins_tight(out[-1], part) else " "
        if out and len(out[-1]) + len(sep) + len(part) <= max_chars:
            out[-1] = f"{out[-1]}{sep}{part}"
        else:
            out.append(part)
    return out


def split_text(text: str, max_chars: int) -> list[str]:
    """Pieces of at most ``max_chars`` characters, in order, ending at sentence boundaries
    where the limit allows. Empty (or all-whitespace) text gives no pieces."""
    if max_chars < 1:
        raise ValueError("max_chars must be positive")
    parts = [p for s in sentences(text) for p in _split_long(s, max_chars)]
    return _pack(parts, max_chars)


class TextStream:
    """Incremental splitter for text that arrives in parts.

    ``feed`` returns the pieces that are complete (a sentence followed by whitespace, or
    text that already exceeds ``max_chars``); ``close`` returns the rest.
    """

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be positive")
        self._max_chars = max_chars
        self._buffer = ""
        self.total_chars = 0
        """Characters received so far (whitespace included)."""

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        self.total_chars += len(text)
        ends = _sentence_ends(self._buffer)
        out: list[str] = []
        start = 0
        for end in ends:
            piece = _normalise(self._buffer[start:end])
            if piece:
                out.extend(_split_long(piece, self._max_chars))
            start = end
        self._buffer = self._buffer[start:]
        rest = _normalise(self._buffer)
        if len(rest) > self._max_chars:
            # No sentence end within the limit: release all but the last, still growing part.
            pieces = _split_long(rest, self._max_chars)
            out.extend(pieces[:-1])
            self._buffer = pieces[-1]
        return out

    def close(self) -> list[str]:
        rest, self._buffer = self._buffer, ""
        return split_text(rest, self._max_chars)
