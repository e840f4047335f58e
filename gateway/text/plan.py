"""What is done to a request's text before the model reads it: its dictionaries' rules, in
order, then normalisation in the request's language (so that a rule for "3D" is applied
before digits are spelled): English's ``gateway.text.normalize``, another language's
``gateway.text.intl``; a language with no normaliser is spoken as written.

A ``TextPlan`` is resolved once per request (or WebSocket context) by
``gateway.text.service.SpeechText.plan`` and carried by its ``SpeechParams``; it is applied
to whole units of text (``SpeechParams.spoken``), never to a piece of a word: the streaming
protocols cut their text into sentences first (``gateway.frontends.text_units``), and the
ZeroMQ protocol's open text goes through ``HeldText``, which holds back the words a rule or
a number might still continue.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from common.languages import DEFAULT_LANGUAGE, SPACELESS
from common.sentences import SentenceEnds
from gateway.text.intl import normalizer_for
from gateway.text.lexicon import Lexicon
from gateway.text.normalize import normalize as normalize_english

_WORD_STARTS = re.compile(r"(?<=\s)\S")


class TextPlan:
    __slots__ = ("_normalizer", "language", "lexicons", "normalize")

    def __init__(
        self, lexicons: tuple[Lexicon, ...], normalize: bool, language: str = DEFAULT_LANGUAGE
    ) -> None:
        """``language``: an ISO 639-1 code (``common.languages.language_tag``)."""
        self.lexicons = lexicons
        self.normalize = normalize
        self.language = language
        self._normalizer: Callable[[str], str] | None = None
        if normalize:
            self._normalizer = normalize_english if language == "en" else normalizer_for(language)

    @property
    def hold_words(self) -> int:
        """Words a stream must hold back before the plan may be applied to what precedes
        them: the longest rule's, two when normalising ("3:30 pm", "$5 million")."""
        most = max((lx.max_words for lx in self.lexicons), default=0)
        return max(most, 2 if self.normalize else 1)

    def apply(self, text: str) -> str:
        for lx in self.lexicons:
            text = lx.apply(text)
        return self._normalizer(text) if self._normalizer is not None else text

    def __repr__(self) -> str:
        return (
            f"TextPlan({len(self.lexicons)} dictionaries, normalize={self.normalize}, "
            f"language={self.language!r})"
        )


class HeldText:
    """A plan applied to text that arrives in pieces (ZeroMQ's ``AppendText``): ``feed``
    returns the rewritten text that is safe to speak now, ``flush`` the rest. In a language
    written without spaces (``common.languages.SPACELESS``) a sentence is the unit held:
    the text up to the last sentence end is safe."""

    def __init__(self, plan: TextPlan) -> None:
        self._plan = plan
        self._hold = plan.hold_words
        self._buffer = ""
        self._ends = SentenceEnds(plan.language) if plan.language in SPACELESS else None

    def feed(self, text: str) -> str:
        self._buffer += text
        buf = self._buffer
        starts = [m.start() for m in _WORD_STARTS.finditer(buf)]
        if buf and not buf[0].isspace():
            starts.insert(0, 0)
        if len(starts) <= self._hold:
            ends = self._ends.find(buf) if self._ends is not None else None
            if not ends:
                return ""
            cut = ends[-1]
        else:
            cut = starts[-self._hold]  # the last ``hold`` words wait for what follows them
        out, self._buffer = buf[:cut], buf[cut:]
        return self._plan.apply(out)

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return self._plan.apply(out) if out else ""
