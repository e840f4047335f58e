"""vLLM-Omni's split_granularity (the units its clients are shown) over the units the gateway
speaks (gateway.frontends.omni.units)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.frontends.omni.units import Close, Event, Granularity, OmniUnits, Speak, unit_ends
from gateway.frontends.text_units import Unit


def run(granularity: Granularity, pieces: list[str], max_chars: int = 280) -> list[Event]:
    units = OmniUnits(granularity, max_chars)
    events: list[Event] = []
    for p in pieces:
        events += units.feed(p)
    return events + units.flush()


def unit(raw: str) -> Unit:
    return Unit(raw, re.sub(r"\s+", " ", raw).strip())


def shown(events: list[Event]) -> list[str]:
    return [e.text for e in events if isinstance(e, Close)]


def spoken(events: list[Event]) -> list[str]:
    return [e.unit.text for e in events if isinstance(e, Speak)]


@pytest.mark.parametrize(
    ("granularity", "text", "want"),
    [
        ("none", "Hi there. How are you?", ["Hi there. How are you?"]),
        ("sentence", "Mr. Smith paid 3.50 dollars. Really?", ["Mr.", "Smith paid 3.50 dollars.", "Really?"]),
        ("sentence", "Wait... what?! Yes", ["Wait...", "what?!", "Yes"]),
        ("sentence", "你好。世界！", ["你好。", "世界！"]),  # CJK ends need no space
        ("sentence", "नमस्ते। ठीक है", ["नमस्ते।", "ठीक है"]),
        ("sentence", "One, two; three.", ["One, two; three."]),
        ("clause", "First of all, we start; then we go.", ["First of all,", "we start;", "then we go."]),
        ("clause", "1,000 miles: far", ["1,", "000 miles: far"]),  # a colon is no end there
        ("clause", "好，走；", ["好，", "走；"]),
    ],
)  # fmt: skip
def test_units_as_vllm_omni_defines_them(
    granularity: Granularity, text: str, want: list[str]
) -> None:
    assert shown(run(granularity, [text])) == want


def test_a_latin_end_waits_for_what_follows() -> None:
    assert unit_ends("Pay 3.", "sentence", flush=False) == []  # "3.5"? "3. "? not yet
    assert unit_ends("Pay 3.5 now. Ok", "sentence", flush=False) == [len("Pay 3.5 now. ")]
    assert unit_ends("Pay 3.", "sentence", flush=True) == [6]
    assert unit_ends("   ", "none", flush=True) == [3]
    assert shown(run("sentence", ["   "])) == []  # a blank flush shows nothing


def test_none_speaks_sentences_before_the_flush() -> None:
    units = OmniUnits("none")
    assert units.feed("Hi there. How") == [Speak(unit("Hi there. "), 0)]
    assert units.feed(" are you?") == []
    assert units.flush() == [Speak(unit("How are you?"), 0), Close(0, "Hi there. How are you?")]
    # Indices restart after a flush.
    assert units.feed("Next.") == []
    assert units.flush() == [Speak(unit("Next."), 0), Close(0, "Next.")]


def test_a_shown_unit_is_bounded_and_spoken_units_are_short() -> None:
    units = OmniUnits("none", max_chars=20, max_shown_chars=50)
    events = units.feed("word " * 30)  # 150 characters, never a flush
    assert [len(t) for t in shown(events)] == [49, 49]
    assert all(len(t) <= 20 for t in spoken(events))
    assert all(len(t) <= 50 for t in shown(events + units.flush()))


_texts = st.lists(
    st.sampled_from(["Hi", "there", "3", ".", "5", "Mr.", ",", ";", ":", "!", "?", "。", " ", "  ", "\n", "é"]),
    max_size=40,
).map("".join)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    granularity=st.sampled_from(["none", "sentence", "clause"]),
    text=_texts,
    cuts=st.lists(st.integers(0, 200), max_size=6),
    max_chars=st.sampled_from([8, 280]),
)
def test_invariants(granularity: Granularity, text: str, cuts: list[int], max_chars: int) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    events = run(granularity, pieces, max_chars)
    # Shown units do not depend on how the text arrived.
    assert shown(events) == shown(run(granularity, [text], max_chars))
    # Every spoken unit belongs to one shown unit, before its Close; together they are its text.
    index = 0
    mine: list[str] = []
    for e in events:
        if isinstance(e, Speak):
            assert e.shown == index
            mine.append(e.unit.raw)
        else:
            assert e.shown == index and mine
            assert re.sub(r"\s", "", "".join(mine)) == re.sub(r"\s", "", e.text)
            index += 1
            mine = []
    assert mine == []
    # Nothing is lost: the shown units are the text.
    assert re.sub(r"\s", "", "".join(shown(events))) == re.sub(r"\s", "", text)
    if granularity == "none":
        assert len(shown(events)) == (1 if text.strip() else 0)
