"""The text corpus shipped with the project: short replies and long paragraphs.

``bench/load/corpus/short.txt`` holds replies of 5-15 words, ``long.txt`` paragraphs of
60-90 words (about 400-470 characters), one per line. A run draws from them with a
seeded generator at a stated mix, so two runs (and the two servers of a comparison) get
the same texts in the same order.
"""

from __future__ import annotations

import random
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec

Kind = Literal["short", "long"]


class Corpus(msgspec.Struct, frozen=True):
    short: tuple[str, ...]
    long: tuple[str, ...]

    def describe(self, long_fraction: float) -> dict[str, object]:
        """The mix as stated in every result."""
        return {
            "short_texts": len(self.short),
            "long_texts": len(self.long),
            "long_fraction": long_fraction,
            "short_words": _word_range(self.short),
            "long_words": _word_range(self.long),
        }


class Utterance(msgspec.Struct, frozen=True):
    kind: Kind
    text: str


def _word_range(texts: tuple[str, ...]) -> list[int]:
    counts = [len(t.split()) for t in texts]
    return [min(counts), max(counts)] if counts else [0, 0]


def _lines(text: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def load_corpus(directory: Path | None = None) -> Corpus:
    """The shipped corpus, or ``short.txt``/``long.txt`` from another directory."""
    if directory is None:
        root = resources.files("bench.load") / "corpus"
        short, long = (root / "short.txt").read_text(), (root / "long.txt").read_text()
    else:
        short = (directory / "short.txt").read_text()
        long = (directory / "long.txt").read_text()
    corpus = Corpus(short=_lines(short), long=_lines(long))
    if not corpus.short and not corpus.long:
        raise ValueError("the corpus is empty")
    return corpus


class UtteranceSource:
    """A seeded, endless sequence of utterances at a given long/short mix."""

    def __init__(self, corpus: Corpus, long_fraction: float, seed: int) -> None:
        if not 0.0 <= long_fraction <= 1.0:
            raise ValueError("long_fraction must be in [0, 1]")
        if long_fraction > 0 and not corpus.long:
            raise ValueError("the corpus has no long texts")
        if long_fraction < 1 and not corpus.short:
            raise ValueError("the corpus has no short texts")
        self._corpus = corpus
        self._long_fraction = long_fraction
        self._rng = random.Random(seed)

    def next(self) -> Utterance:
        if self._rng.random() < self._long_fraction:
            return Utterance("long", self._rng.choice(self._corpus.long))
        return Utterance("short", self._rng.choice(self._corpus.short))
