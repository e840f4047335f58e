"""Text normalisation (gateway.text.normalize), one example or more per category, and the
text plans that apply dictionaries and normalisation to streamed text (gateway.text.plan)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.frontends.text_units import UnitSplitter
from gateway.text.lexicon import AliasRule, Lexicon
from gateway.text.normalize import normalize
from gateway.text.plan import HeldText, TextPlan

CASES = {
    "number": [
        ("I have 42 apples.", "I have forty-two apples."),
        ("It has 1,234 items.", "It has one thousand, two hundred and thirty-four items."),
        ("Pi is 3.14.", "Pi is three point one four."),
        ("It is -3 outside.", "It is minus three outside."),
        ("Agent 007.", "Agent zero zero seven."),
        ("Pages 10-20.", "Pages ten to twenty."),
    ],
    "ordinal": [("The 21st time.", "The twenty-first time."), ("2nd place", "second place")],
    "currency": [
        ("It costs $3.50.", "It costs three dollars and fifty cents."),
        ("It was $1.", "It was one dollar."),
        ("We raised €5 million.", "We raised five million euros."),
        ("Only £0.99 each.", "Only ninety-nine pence each."),
    ],
    "percentage": [("Up 12.5% today.", "Up twelve point five percent today.")],
    "date": [
        ("Due 2024-03-05.", "Due March fifth, twenty twenty-four."),
        ("Due 3/5/2024.", "Due March fifth, twenty twenty-four."),
        ("On March 5, 2024 we met.", "On March fifth, twenty twenty-four we met."),
        ("On 5 March 2024.", "On the fifth of March twenty twenty-four."),
    ],
    "time": [
        ("Meet at 3:30 pm.", "Meet at three thirty p m."),
        ("At 14:05 sharp.", "At fourteen oh five sharp."),
        ("At 9:00.", "At nine o'clock."),
    ],
    "year": [
        ("In 1999 it began.", "In nineteen ninety-nine it began."),
        ("Since 2005.", "Since two thousand and five."),
        ("The 1990s.", "The nineteen nineties."),
    ],
    "phone": [
        ("Call (555) 123-4567.", "Call five five five, one two three, four five six seven."),
        (
            "Call +44 20 7946 0958.",
            "Call plus four four, two zero, seven nine four six, zero nine five eight.",
        ),
    ],
    "unit": [
        ("Run 10 km.", "Run ten kilometers."),
        ("Lift 5kg.", "Lift five kilograms."),
        ("It is 20°C.", "It is twenty degrees Celsius."),
        ("Just 1 mile, 1 km.", "Just one mile, one kilometer."),
        ("A 3 GHz chip.", "A three gigahertz chip."),
    ],
    "abbreviation": [
        ("Dr. Smith vs. Mr. Jones", "Doctor Smith versus Mister Jones"),
        ("Apples, pears, etc.", "Apples, pears, et cetera."),
        ("Rock & roll", "Rock and roll"),
    ],
    "url": [
        ("See https://example.com/docs.", "See example dot com slash docs."),
        (
            "Go to www.example.org now",
            "Go to w w w dot example dot org now".replace("w w w", "www"),
        ),
    ],
    "email": [("Mail jane.doe@example.com now.", "Mail jane dot doe at example dot com now.")],
}


@pytest.mark.parametrize(
    ("text", "spoken"),
    [pair for pairs in CASES.values() for pair in pairs],
    ids=[f"{cat}-{i}" for cat, pairs in CASES.items() for i in range(len(pairs))],
)
def test_each_category_is_written_as_words(text: str, spoken: str) -> None:
    assert normalize(text) == spoken


def test_emotion_tags_and_plain_text_pass_untouched() -> None:
    assert normalize("<laugh> 5 cats <sigh> and <chuckle>") == (
        "<laugh> five cats <sigh> and <chuckle>"
    )
    plain = "Hello there, nothing to do here."
    assert normalize(plain) is plain  # the quick check skips the scan


@given(st.text(max_size=200))
def test_normalize_never_fails_and_keeps_tags(text: str) -> None:
    out = normalize(text + " <laugh>")
    assert out.endswith(" <laugh>")


def kubernetes() -> TextPlan:
    return TextPlan(
        (Lexicon([AliasRule(string_to_replace="Kubernetes", alias="koo-ber-net-eez")]),), False
    )


def test_a_rule_is_applied_across_streamed_pieces_by_units() -> None:
    """Front ends that cut units (the WebSockets) apply the plan to whole units: "Kuber" +
    "netes " is one word by the time the rule sees it."""
    plan = kubernetes()
    splitter = UnitSplitter("sentence", 280)
    units = splitter.feed("I use Kuber") + splitter.feed("netes daily. ") + splitter.flush()
    assert [plan.apply(u.text) for u in units] == ["I use koo-ber-net-eez daily."]


def test_held_text_never_splits_a_word_or_a_rule() -> None:
    plan = TextPlan(
        (
            Lexicon(
                [
                    AliasRule(string_to_replace="Kubernetes", alias="K8S-WORD"),
                    AliasRule(string_to_replace="New York", alias="the big apple"),
                ]
            ),
        ),
        True,
    )
    held = HeldText(plan)
    pieces = ["I run Kuber", "netes in New ", "York at 3:30 ", "pm for $5", " million."]
    out = "".join(held.feed(p) for p in pieces) + held.flush()
    assert out == ("I run K8S-WORD in the big apple at three thirty p m for five million dollars.")


@given(st.lists(st.text(alphabet="ab Kuberntes.", max_size=8), max_size=12))
def test_held_text_equals_the_plan_on_the_whole_text_for_word_rules(pieces: list[str]) -> None:
    plan = kubernetes()
    held = HeldText(plan)
    out = "".join(held.feed(p) for p in pieces) + held.flush()
    assert out == plan.apply("".join(pieces))


def test_lexicon_options_and_longest_match_first() -> None:
    lx = Lexicon(
        [
            AliasRule(string_to_replace="SQL", alias="sequel"),
            AliasRule(string_to_replace="SQL Server", alias="sequel server"),
            AliasRule(string_to_replace="nginx", alias="engine x", case_sensitive=False),
            AliasRule(string_to_replace="co", alias="company", word_boundaries=True),
            AliasRule(string_to_replace="ß", alias="ss", word_boundaries=False),
        ]
    )
    assert lx.apply("SQL Server and SQL, not sql.") == "sequel server and sequel, not sql."
    assert lx.apply("NGINX or Nginx") == "engine x or engine x"
    assert lx.apply("co cold") == "company cold"
    assert lx.apply("Straße") == "Strasse"
