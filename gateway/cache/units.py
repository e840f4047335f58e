"""A whole text's units as the cache keys them: its sentences, whitespace collapsed.

The streaming protocols cut their text into sentence units as it arrives
(``gateway.frontends.text_units``); an HTTP request's text is one worker stream. With the
cache on, an HTTP text of several sentences is looked up sentence by sentence from its
start (``gateway.requests``): the longest run of cached sentences plays at once and the
rest is one worker stream, submitted when the request starts. The sentences are cut where
``common.sentences`` cuts them (every language's abbreviations kept whole, as the streaming
protocols' default), so a greeting spoken alone, in a socket's unit or an HTTP request, has
the same key as the same greeting opening a longer text.
"""

from __future__ import annotations

from common.sentences import SentenceEnds

_ENDS = SentenceEnds(None)


def unit_text(text: str) -> str:
    """``text`` as keyed: whitespace collapsed (the llm worker reads it so)."""
    return " ".join(text.split())


def sentences(text: str) -> list[str]:
    """The sentences of a whole ``text`` (its last one ends at the text's end), keyed form."""
    out: list[str] = []
    start = 0
    for end in [*_ENDS.find(text), len(text)]:
        if s := unit_text(text[start:end]):
            out.append(s)
        start = end
    return out
