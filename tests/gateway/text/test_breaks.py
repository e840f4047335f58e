"""The break tag parser (``gateway.text.breaks``) and the unit splitter's cut at break tags
(``gateway.frontends.text_units``): what is honoured, what is refused, and the invariants
(tags never reach the text to speak, pauses within the cap, a tag split anywhere across
pieces read as if whole)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.frontends.text_units import Unit, UnitSplitter
from gateway.schemas import SpeechParams
from gateway.text.breaks import (
    MAX_TAG_CHARS,
    STRENGTH_MS,
    BreakError,
    BreakScanner,
    Pause,
    Piece,
    join_breaks,
    split_breaks,
    without_breaks,
)
from gateway.text.plan import TextPlan

CAP = 3000


@pytest.mark.parametrize(
    ("tag", "ms"),
    [
        ('<break time="1.5s" />', 1500),
        ('<break time="500ms"/>', 500),
        ("<break time='2s'>", 2000),
        ('<BREAK TIME="1S"/>', 1000),
        ('<break time=" 0.25 s "/>', 250),
        ('<break time="0s"/>', 0),
        ('<break time="3s"/>', 3000),
        ("<break/>", 750),
        ("<break>", 750),
        ('<break strength="none"/>', 0),
        ('<break strength="x-weak"/>', 250),
        ('<break strength="weak"/>', 500),
        ('<break strength="medium"/>', 750),
        ('<break strength="strong"/>', 1000),
        ('<break strength="X-Strong"/>', 1250),
        ('<break strength="weak" time="2s"/>', 2000),  # time wins, as in SSML
        ('<break\ntime="1s"\n/>', 1000),
    ],
)
def test_honoured_tags(tag: str, ms: int) -> None:
    assert split_breaks(f"A {tag} B", CAP) == ["A ", Pause(ms), " B"]


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ('<break time="3001ms"/>', "break_too_long"),
        ('<break time="4s"/>', "break_too_long"),
        ('<break time="-1s"/>', "invalid_break"),
        ('<break time="1"/>', "invalid_break"),
        ('<break time="1 sec"/>', "invalid_break"),
        ("<break time=1s/>", "invalid_break"),
        ('<break strength="loud"/>', "invalid_break"),
        ('<break pause="1s"/>', "invalid_break"),
        ('<break time="1s" time="2s"/>', "invalid_break"),
        ('<break time="1s"', "invalid_break"),
        ('<break time="1s" <break/>', "invalid_break"),
        ("<break " + "x" * MAX_TAG_CHARS, "invalid_break"),
    ],
)
def test_refused_tags(text: str, code: str) -> None:
    with pytest.raises(BreakError) as e:
        split_breaks(f"Say {text} this.", CAP)
    assert e.value.status == 400 and e.value.code == code


@pytest.mark.parametrize(
    "text",
    ["a < b", "x<y", "<laugh> ha", "<breakfast> is ready", "<b>bold</b>", "ends with <b", "<"],
)
def test_other_angle_brackets_are_text(text: str) -> None:
    assert split_breaks(text, CAP) == [text]


def test_tags_at_one_place_make_one_pause_under_the_cap() -> None:
    two = '<break time="2s"/>'
    assert split_breaks(f"a{two}b{two}c", CAP) == ["a", Pause(2000), "b", Pause(2000), "c"]
    for text in (f"a{two}{two}b", f"a{two} \n {two}b"):
        with pytest.raises(BreakError) as e:
            split_breaks(text, CAP)
        assert e.value.code == "break_too_long" and "add up to a pause of 4000 ms" in str(e.value)
    scanner = BreakScanner(CAP)  # across messages too
    scanner.feed(f"a{two} ")
    with pytest.raises(BreakError):
        scanner.feed(two)


def test_no_cap() -> None:
    assert split_breaks('<break time="60s"/>', None) == [Pause(60_000)]


# -- invariants -----------------------------------------------------------------------------

_words = st.text(alphabet="abc <>.,!é\n", min_size=0, max_size=12).filter(
    lambda s: "<" not in s or ("<b" not in s.lower() and not s.endswith("<"))
)
_durations = st.one_of(
    st.integers(0, CAP // 2).map(lambda ms: (f'time="{ms}ms"', ms)),
    st.integers(0, CAP // 20).map(lambda cs: (f'time="{cs / 100:g}s"', cs * 10)),
    st.sampled_from(sorted(STRENGTH_MS.items())).map(lambda kv: (f'strength="{kv[0]}"', kv[1])),
)


@st.composite
def _texts(draw: st.DrawFn) -> tuple[str, list[Piece]]:
    """A text with break tags, and the pieces it must read as (runs merged)."""
    text, pieces = "", []
    place = 0
    for _ in range(draw(st.integers(0, 5))):
        words = draw(_words)
        attr, ms = draw(_durations)
        place = (0 if words.strip() else place) + ms
        assume(place <= CAP)  # the tags at one place make one pause, under the cap
        close = draw(st.sampled_from(["/>", " />", ">"]))
        text += words + f"<break {attr}{close}"
        if words:
            pieces.append(words)
        pieces.append(Pause(ms))
    tail = draw(_words)
    text += tail
    if tail:
        pieces.append(tail)
    return text, pieces


def _merged(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return out


@settings(max_examples=300, deadline=None)
@given(_texts(), st.lists(st.integers(0, 400), max_size=6))
def test_pieces_read_whole_or_cut_anywhere(case: tuple[str, list[Piece]], cuts: list[int]) -> None:
    text, expected = case
    assert split_breaks(text, CAP) == expected
    # The same text in pieces, cut anywhere (inside a tag too): the same pauses and runs.
    scanner = BreakScanner(CAP)
    got: list[Piece] = []
    bounds = sorted({min(c, len(text)) for c in cuts})
    start = 0
    for b in [*bounds, len(text)]:
        got += scanner.feed(text[start:b])
        assert len(scanner.held) <= MAX_TAG_CHARS
        start = b
    got += scanner.flush()
    assert _merged(got) == expected
    for p in got:  # no tag ever reaches the text to speak; every pause within the cap
        assert (isinstance(p, Pause) and 0 <= p.ms <= CAP) or "<break" not in str(p).lower()
    assert without_breaks(text) == "".join(p for p in expected if isinstance(p, str))
    assert split_breaks(join_breaks(expected), CAP) == expected


@settings(max_examples=200, deadline=None)
@given(_texts(), st.integers(CAP + 1, 100_000), st.integers(0, 200))
def test_over_the_cap_is_refused_wherever_the_cut(
    case: tuple[str, list[Piece]], ms: int, cut: int
) -> None:
    text = case[0] + f' <break time="{ms}ms"/> end'
    with pytest.raises(BreakError):
        split_breaks(text, CAP)
    scanner = BreakScanner(CAP)
    cut = min(cut, len(text))
    with pytest.raises(BreakError):
        scanner.feed(text[:cut])
        scanner.feed(text[cut:])
        scanner.flush()


@settings(max_examples=200, deadline=None)
@given(_texts(), st.lists(st.integers(0, 400), max_size=4))
def test_units_hold_no_tag_and_every_pause(case: tuple[str, list[Piece]], cuts: list[int]) -> None:
    text, expected = case
    splitter = UnitSplitter("sentence", 50, CAP)
    units = []
    start = 0
    for b in [*sorted({min(c, len(text)) for c in cuts}), len(text)]:
        units += splitter.feed(text[start:b])
        start = b
    units += splitter.flush()
    assert all("<break" not in u.raw.lower() for u in units)
    assert sum(u.pause_ms for u in units) == sum(p.ms for p in expected if isinstance(p, Pause))
    # The raw text of the units is the text without its tags (whitespace-only pieces
    # dropped, as between two sentences).
    spoken = "".join(u.raw for u in units)
    assert "".join(spoken.split()) == "".join(without_breaks(text).split())


def test_a_break_is_a_unit_boundary() -> None:
    s = UnitSplitter("sentence", 280, CAP)
    assert s.feed('Hello there <break time="1s"/> how are <bre') == [
        Unit("Hello there ", "Hello there")
    ]
    assert s.pending == " how are <bre"  # the tag's start is held, and counted
    units = s.feed('ak time="500ms"/>you? <break/>') + s.flush()
    assert [(u.raw, u.pause_ms) for u in units] == [(" how are ", 1000), ("you? ", 500), ("", 750)]


def test_spoken_rewrites_runs_and_keeps_tags() -> None:
    params = SpeechParams(
        text='I have 3 cats. <break time="1.5s"/> And 2 dogs.',
        voice="tara",
        text_plan=TextPlan((), normalize=True),
    )
    assert params.spoken().text == 'I have three cats. <break time="1500ms"/> And two dogs.'
