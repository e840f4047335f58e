"""The precomputed arrival schedule and the shipped text corpus."""

from __future__ import annotations

import pytest

from bench.load.schedule import poisson_schedule
from bench.load.texts import UtteranceSource, load_corpus


def test_schedule_is_seeded_sorted_and_bounded() -> None:
    a = poisson_schedule(20.0, 50.0, seed=7)
    assert a == poisson_schedule(20.0, 50.0, seed=7)
    assert a != poisson_schedule(20.0, 50.0, seed=8)
    assert a == sorted(a) and 0 < a[0] and a[-1] < 50.0
    # 1000 expected arrivals: a seeded draw within 10% of the rate
    assert 900 <= len(a) <= 1100
    assert poisson_schedule(20.0, 50.0, seed=7, max_count=5) == a[:5]


def test_schedule_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        poisson_schedule(0.0, 10.0, seed=1)


def test_corpus_has_short_replies_and_long_paragraphs() -> None:
    corpus = load_corpus()
    assert len(corpus.short) >= 50 and len(corpus.long) >= 15
    assert all(5 <= len(t.split()) <= 15 for t in corpus.short)
    assert all(len(t.split()) >= 60 for t in corpus.long)
    mix = corpus.describe(0.2)
    assert mix["long_fraction"] == 0.2 and mix["short_words"][0] >= 5


def test_utterance_source_is_seeded_and_keeps_the_mix() -> None:
    corpus = load_corpus()
    draw = UtteranceSource(corpus, 0.25, seed=3)
    first = [draw.next() for _ in range(2000)]
    again = UtteranceSource(corpus, 0.25, seed=3)
    assert first == [again.next() for _ in range(2000)]
    share = sum(u.kind == "long" for u in first) / len(first)
    assert 0.22 <= share <= 0.28
    only_short = UtteranceSource(corpus, 0.0, seed=1)
    assert all(only_short.next().kind == "short" for _ in range(100))
