"""Where sentences (and clauses) end, per language: the one rule both splitters use.

The gateway cuts streamed text into units at sentence ends (``gateway.frontends.text_units``)
and the llm worker cuts long text into pieces the model speaks well (``llm_worker.text``);
both ask ``SentenceEnds`` where the ends are, so that a unit the gateway made is never cut
again differently by the worker.

An end is:

- ``.``, ``!``, ``?`` or ``…`` (a run of them), then closing quotes or brackets, then
  whitespace or a CJK character ("你好!我们" ends after the ``!``). A ``.`` after a known
  abbreviation of the language (``Dr.``, ``z.B.``, ``Mme.``) or after a single letter (an
  initial: "J. Smith") ends nothing. "3.14" and "e.g.x" are not followed by whitespace.
- The ideographic full stop and the fullwidth marks (``。！？｡``) and the Devanagari danda
  (``।``, ``॥``), then closing quotes or brackets, then anything else: Chinese and Japanese
  put no space after a sentence. At the very end of the text such an end waits for what
  follows (a closing quote may still come), as a Latin end waits for its space; a flush
  releases it.

A clause also ends at ``,``, ``;``, ``:`` or a spaced dash followed by whitespace, and at
the fullwidth ``，、；：`` followed by anything but a closing quote.

Import-light (re only).
"""

from __future__ import annotations

import re
from typing import ClassVar

from common.languages import language_tag

__all__ = ["SentenceEnds", "abbreviations", "joins_tight"]

_CLOSERS = "\"'”’)\\]»」』）】》"
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WIDE_ENDS = "。！？｡।॥"

_SENTENCE = (
    rf"[.!?…]+[{_CLOSERS}]*(?=\s|[{_CJK}])"
    rf"|[.!?…]*[{_WIDE_ENDS}][{_WIDE_ENDS}!?…]*[{_CLOSERS}]*(?=[^{_WIDE_ENDS}!?…{_CLOSERS}])"
)
_CLAUSE = rf"{_SENTENCE}|(?:[,;:]|(?<=\s)[-–—])[{_CLOSERS}]*(?=\s)|[，、；：][{_CLOSERS}]*(?=[^{_CLOSERS}])"

_ABBREVIATIONS: dict[str, frozenset[str]] = {
    lang: frozenset(words.split())
    for lang, words in {
        "en": "mr mrs ms dr prof sr jr st mt vs etc e.g i.e no fig approx dept est inc ltd co"
        " corp ave blvd rd jan feb aug sept oct nov dec",
        "fr": "m mm mme mmes mlle mlles dr pr me st ste etc cf p.ex ex av bd env vol chap fig"
        " janv févr avr juil sept oct nov déc",
        "de": "hr hrn fr dr prof bzw usw z.b d.h u.a o.ä ca nr str evtl ggf vgl inkl s.o s.u"
        " bspw abs jh mio mrd",
        "es": "sr sra srta sres dr dra ud uds etc p.ej pág núm av avda dña d lic ing",
        "it": "sig sigg dott dr prof ecc es pag avv ing geom arch rag",
        "pt": "sr sra srta dr dra prof etc ex pág av eng",
        "nl": "dhr mevr dr prof bijv enz m.a.w o.a nr blz",
    }.items()
}
_ALL = frozenset().union(*_ABBREVIATIONS.values())


_TIGHT = re.compile(rf"[{_CJK}{_WIDE_ENDS}，、；：{_CLOSERS}]")


def joins_tight(left: str, right: str) -> bool:
    """Whether two pieces of text join with no space between them (either side is CJK
    text or its punctuation: "你好。" + "我们" is "你好。我们")."""
    return bool(left and right and (_TIGHT.match(left[-1]) or _TIGHT.match(right[0])))


def abbreviations(language: str | None) -> frozenset[str]:
    """The words (lower case, inner dots kept, final dot dropped) after which a ``.`` does
    not end a sentence in ``language``; None: those of every language the server knows."""
    if language is None:
        return _ALL
    return _ABBREVIATIONS.get(language_tag(language), frozenset())


class SentenceEnds:
    """``find(text)``: offsets just past each end in ``text`` (after its closing quotes,
    before the whitespace that follows it)."""

    __slots__ = ("_abbr", "_pattern")

    _PATTERNS: ClassVar[dict[bool, re.Pattern[str]]] = {
        False: re.compile(_SENTENCE),
        True: re.compile(_CLAUSE),
    }

    def __init__(self, language: str | None = None, *, clauses: bool = False) -> None:
        self._abbr = abbreviations(language)
        self._pattern = self._PATTERNS[clauses]

    def _abbreviation(self, text: str, dot: int) -> bool:
        start = dot
        while start > 0 and (text[start - 1].isalpha() or text[start - 1] == "."):
            start -= 1
        word = text[start:dot]
        return (len(word) == 1 and word.isalpha()) or word.lower() in self._abbr

    def find(self, text: str) -> list[int]:
        ends = []
        for m in self._pattern.finditer(text):
            s = m.group()
            if s[0] == "." and (len(s) == 1 or s[1] in _CLOSERS):
                if self._abbreviation(text, m.start()):
                    continue
            ends.append(m.end())
        return ends
