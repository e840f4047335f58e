"""Splitting long text at sentence boundaries (and the incremental splitter for open text)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_worker.text import TextStream, normalise_tags, sentences, split_text


def test_sentences() -> None:
    text = "Hello there!  How are you?\nFine. Dr. Smith paid $3.50, i.e. not much… Right"
    assert sentences(text) == [
        "Hello there!",
        "How are you?",
        "Fine.",
        "Dr. Smith paid $3.50, i.e. not much…",
        "Right",
    ]


def test_short_text_is_one_piece() -> None:
    assert split_text("  Just one short line.  ", 280) == ["Just one short line."]
    assert split_text("", 280) == [] and split_text(" \n\t ", 280) == []


def test_sentences_are_packed_up_to_the_limit() -> None:
    text = "One two. Three four. Five six. Seven eight."
    assert split_text(text, 22) == ["One two. Three four.", "Five six. Seven eight."]
    assert split_text(text, 9) == ["One two.", "Three", "four.", "Five six.", "Seven", "eight."]


def test_long_sentence_splits_at_clauses_then_words_then_hard() -> None:
    clause = "first clause here, second clause there; third one"
    assert split_text(clause, 20) == ["first clause here,", "second clause there;", "third one"]
    assert split_text("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]


def test_emotion_tags_stay_whole() -> None:
    assert split_text("I laughed <laugh> so hard. Then <sigh> I stopped.", 30) == [
        "I laughed <laugh> so hard.",
        "Then <sigh> I stopped.",
    ]


words = st.text(alphabet="abcdefghij", min_size=1, max_size=12)
seps = st.sampled_from([" ", ". ", "! ", "? ", ", ", "; ", "\n", ".\n\n"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(words, seps), min_size=1, max_size=60), st.integers(5, 80))
def test_pieces_keep_every_word_in_order_within_the_limit(
    parts: list[tuple[str, str]], max_chars: int
) -> None:
    text = "".join(w + s for w, s in parts)
    pieces = split_text(text, max_chars)
    assert all(0 < len(p) <= max_chars for p in pieces)
    assert "".join(" ".join(pieces).split()) == "".join(text.split())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(words, seps), min_size=1, max_size=40), st.integers(10, 60),
       st.lists(st.integers(1, 15), min_size=1, max_size=30))  # fmt: skip
def test_stream_keeps_every_word_in_order(
    parts: list[tuple[str, str]], max_chars: int, cuts: list[int]
) -> None:
    text = "".join(w + s for w, s in parts)
    stream, out, at, i = TextStream(max_chars), [], 0, 0
    while at < len(text):
        n = cuts[i % len(cuts)]
        out += stream.feed(text[at : at + n])
        at, i = at + n, i + 1
    out += stream.close()
    assert all(0 < len(p) <= max_chars for p in out)
    assert "".join(" ".join(out).split()) == "".join(text.split())
    assert stream.total_chars == len(text)


def test_stream_releases_each_sentence_once_complete() -> None:
    s = TextStream(100)
    assert s.feed("Hello the") == []
    assert s.feed("re. How") == ["Hello there."]
    assert s.feed(" are you? I am") == ["How are you?"]
    assert s.feed(" fine.") == [], "a sentence end needs the next whitespace (or close)"
    assert s.close() == ["I am fine."]


def test_stream_cuts_text_without_sentence_ends_at_the_limit() -> None:
    s = TextStream(12)
    out = s.feed("aaa bbb ccc ddd eee fff")
    assert out and all(len(p) <= 12 for p in out)
    assert " ".join(out + s.close()) == "aaa bbb ccc ddd eee fff"


def test_emotion_tags_are_normalised_unknown_ones_left_alone() -> None:
    tags = frozenset({"laugh", "sigh"})
    text = "Ha < Laugh > ok <SIGH> and <3 or <unknown> x<laugh>"
    assert normalise_tags(text, tags) == "Ha <laugh> ok <sigh> and <3 or <unknown> x<laugh>"
