"""Languages: codes, sentence ends per language and script, normalisation per language, a
plan's language, a PLS dictionary's language, the languages of voices and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import ServeConfig
from common.config.llm import LLMConfig, LoraVoice
from common.config.text import TextConfig
from common.languages import UnknownLanguage, language_tag
from common.sentences import SentenceEnds
from gateway.errors import APIError
from gateway.frontends.text_units import UnitSplitter
from gateway.text.intl import LANGUAGES, normalizer_for
from gateway.text.lexicon import AliasRule, Lexicon
from gateway.text.plan import HeldText, TextPlan
from gateway.text.pls import PlsError, read_pls
from gateway.voices.languages import VoiceLanguages
from llm_worker.model_info import load_model_info
from llm_worker.text import sentences, split_text
from orchestrator.settings import language_problems

# -- codes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "tag"),
    [("fr", "fr"), ("FR", "fr"), ("fr-CA", "fr"), ("zh_Hans_CN", "zh"), ("cmn", "zh"),
     ("fra", "fr"), ("French", "fr"), (" hi ", "hi"), ("pt-BR", "pt")],
)  # fmt: skip
def test_language_tags(code: str, tag: str) -> None:
    assert language_tag(code) == tag


@pytest.mark.parametrize("code", ["", "xx", "klingon", "f", "fr--CA", "12", "en US"])
def test_unknown_codes_are_refused_saying_what_is_taken(code: str) -> None:
    with pytest.raises(UnknownLanguage, match="ISO 639-1"):
        language_tag(code)


# -- sentence ends -----------------------------------------------------------------------------


def split(text: str, language: str | None = None) -> list[str]:
    s = UnitSplitter("sentence", 280, language=language)
    return [u.text for u in (*s.feed(text), *s.flush())]


@pytest.mark.parametrize(
    ("language", "text", "units"),
    [
        ("zh", "今天很好。我们走吧！你呢？好", ["今天很好。", "我们走吧！", "你呢？", "好"]),
        ("zh", "他说：“你好。”然后走了。", ["他说：“你好。”", "然后走了。"]),
        ("ja", "こんにちは。元気ですか？はい", ["こんにちは。", "元気ですか？", "はい"]),
        ("zh", "好!我们走", ["好!", "我们走"]),
        ("hi", "यह अच्छा है। वह कहाँ है॥ ठीक", ["यह अच्छा है।", "वह कहाँ है॥", "ठीक"]),
        ("fr", "M. Dupont et Mme. Durand arrivent. Bien.", ["M. Dupont et Mme. Durand arrivent.",
                                                          "Bien."]),
        ("de", "Das ist z.B. gut. Hr. Meier kommt.", ["Das ist z.B. gut.", "Hr. Meier kommt."]),
        ("es", "La Sra. García llegó. Bien.", ["La Sra. García llegó.", "Bien."]),
        ("en", "Dr. Smith is here. Pi is 3.14 today.", ["Dr. Smith is here.",
                                                        "Pi is 3.14 today."]),
    ],
)  # fmt: skip
def test_units_end_at_each_languages_sentence_ends(
    language: str, text: str, units: list[str]
) -> None:
    assert split(text, language) == units


def test_the_llm_worker_splits_where_the_gateway_does() -> None:
    text = "今天很好。我们走吧！ Dr. Smith came. यह है। ठीक"
    assert sentences(text) == ["今天很好。", "我们走吧！", "Dr. Smith came.", "यह है।", "ठीक"]
    long = "我们" * 100 + "，" + "你们" * 100 + "。"
    assert all(len(p) <= 250 for p in split_text(long, 250))


def test_a_wide_end_waits_for_what_follows_when_streamed() -> None:
    s = UnitSplitter("sentence", 280, language="zh")
    assert s.feed("你好。") == []  # a closing quote may still come
    assert [u.text for u in s.feed("」我")] == ["你好。」"]
    assert [u.text for u in s.flush()] == ["我"]


_CJK = st.text(alphabet=st.sampled_from(list("你好我们是的人。！？，")), max_size=60)
_LATIN = st.text(alphabet=st.sampled_from(list("ab .!?,Dr")), max_size=60)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(_CJK, _LATIN), cuts=st.lists(st.integers(0, 60), max_size=4))
def test_units_lose_nothing_however_the_text_arrives(text: str, cuts: list[int]) -> None:
    """Fed in pieces or whole, the units' raw text is the text, in order, and the ends are
    the same wherever the pieces were cut."""
    s = UnitSplitter("sentence", 280, language="zh")
    pieces, last = [], 0
    for c in sorted(min(c, len(text)) for c in cuts):
        pieces.append(text[last:c])
        last = c
    pieces.append(text[last:])
    units = [u for p in pieces for u in s.feed(p)] + s.flush()
    assert "".join(u.raw for u in units).strip() == text.strip() or not text.strip()
    whole = UnitSplitter("sentence", 280, language="zh")
    assert [u.text for u in units] == [u.text for u in (*whole.feed(text), *whole.flush())]


@given(st.text(max_size=80))
def test_sentence_ends_are_inside_the_text_and_increasing(text: str) -> None:
    for language in (None, "fr", "zh"):
        ends = SentenceEnds(language).find(text)
        assert ends == sorted(set(ends))
        assert all(0 < e <= len(text) for e in ends)


# -- normalisation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("language", "text", "spoken"),
    [
        ("fr", "Il a 21 ans.", "Il a vingt et un ans."),
        ("fr", "3,5 % de 1 000 000", "trois virgule cinq pour cent de un million"),
        ("fr", "12,50 € et 1 €", "douze euros et cinquante centimes et un euro"),
        ("fr", "le 1er, la 1re, le 21e", "le premier, la première, le vingt et unième"),
        ("fr", "à 14h05 et 9h", "à quatorze heures cinq et neuf heures"),
        ("fr", "le 05/03/2024", "le cinq mars deux mille vingt-quatre"),
        ("fr", "le 1 mai 2024", "le premier mai deux mille vingt-quatre"),
        ("fr", "-3 et 1.234", "moins trois et mille deux cent trente-quatre"),
        ("de", "Am 5. März 2024", "Am fünfte März zweitausendvierundzwanzig"),
        ("de", "1.234,5 und 14:05", "eintausendzweihundertvierunddreißig Komma fünf und "
                                    "vierzehn Uhr fünf"),
        ("es", "El 1º y la 2ª: 21", "El primero y la segunda: veintiuno"),
        ("es", "2024-03-05", "cinco de marzo de dos mil veinticuatro"),
        ("it", "alle 14:05, 12,50 €", "alle quattordici e cinque, dodici euro e cinquanta "
                                      "centesimi"),
        ("pt", "R$ 12,50", "doze reais e cinquenta cêntimos"),
        ("nl", "21 mensen", "eenentwintig mensen"),
        ("ko", "3.5% 2024년", "삼 점 오 퍼센트 이천이십사년"),
        ("ja", "¥500です", "五百円です"),
        ("zh", "2024年3月5日，15%，￥30，14:05", "二零二四年三月五日，百分之十五，三十元，十四点零五分"),
        ("zh", "气温25.5度", "气温二十五点五度"),
        ("hi", "यह 21 है। ₹5", "यह इक्कीस है। पाँच रुपये"),
        ("ru", "21 и 3,5", "двадцать один и три целых пять десятых"),
    ],
)  # fmt: skip
def test_each_language_is_spoken_in_its_own_words(language: str, text: str, spoken: str) -> None:
    normalize = normalizer_for(language)
    assert normalize is not None
    assert normalize(text) == spoken


@pytest.mark.parametrize("language", ["fr", "de", "zh", "ko"])
def test_what_is_not_a_number_is_left_as_written(language: str) -> None:
    normalize = normalizer_for(language)
    assert normalize is not None
    for text in ("MP3, 3D et A4", "<laugh> voilà", "https://a.fr/21", "jean@x21.fr", "9:75"):
        assert normalize(text) == text


def test_a_language_with_no_normaliser_is_spoken_as_written() -> None:
    assert normalizer_for("sw") is None
    plan = TextPlan((), True, "sw")
    assert plan.apply("Ana miaka 21.") == "Ana miaka 21."
    assert {"fr", "de", "es", "it", "pt", "nl", "ko", "ja", "zh", "hi"} <= LANGUAGES


_DIGITS = st.from_regex(r"[1-9]\d{0,6}", fullmatch=True)


@settings(max_examples=100, deadline=None)
@given(n=_DIGITS, language=st.sampled_from(["fr", "de", "es", "it", "pt", "ko", "ja", "zh", "hi"]))
def test_no_digit_is_left_and_no_english_word_is_said(n: str, language: str) -> None:
    normalize = normalizer_for(language)
    assert normalize is not None
    out = normalize(f"x {n} x")
    assert not any(c.isdigit() for c in out)
    english = set("one two three four five twenty hundred thousand".split())
    assert not english & set(out.split())


@given(st.text(max_size=60))
def test_normalisers_never_fail(text: str) -> None:
    for language in ("fr", "de", "zh", "hi", "ko", "ru"):
        normalize = normalizer_for(language)
        assert normalize is not None
        normalize(text)


def test_a_plan_normalises_in_its_language_after_its_rules() -> None:
    rules = Lexicon([AliasRule(string_to_replace="TGV", alias="té jé vé")])
    assert (
        TextPlan((rules,), True, "fr").apply("Le TGV de 21 h.") == "Le té jé vé de vingt et un h."
    )
    assert TextPlan((), True, "en").apply("He is 21.") == "He is twenty-one."
    assert TextPlan((), False, "fr").apply("21") == "21"


# -- dictionaries ------------------------------------------------------------------------------


def _pls(lang: str | None) -> bytes:
    attr = f' xml:lang="{lang}"' if lang is not None else ""
    return (
        '<?xml version="1.0"?><lexicon version="1.0" '
        f'xmlns="http://www.w3.org/2005/01/pronunciation-lexicon"{attr}>'
        "<lexeme><grapheme>a</grapheme><alias>b</alias></lexeme></lexicon>"
    ).encode()


def test_a_pls_file_carries_its_language() -> None:
    assert read_pls(_pls("fr-FR"), max_bytes=4096, max_rules=10).language == "fr"
    assert read_pls(_pls(None), max_bytes=4096, max_rules=10).language is None
    with pytest.raises(PlsError, match="xml:lang: unknown language 'zz'"):
        read_pls(_pls("zz"), max_bytes=4096, max_rules=10)


# -- voices and checkpoints --------------------------------------------------------------------


def _config(**llm: object) -> ServeConfig:
    return ServeConfig(llm=LLMConfig(**llm), text=TextConfig(language="en"))  # type: ignore[arg-type]


def test_a_requests_language_is_its_own_then_its_voices_then_the_checkpoints() -> None:
    langs = VoiceLanguages(
        _config(
            voices=["pierre", "jana"], default_voice="pierre", languages=["fr", "de"],
            voice_languages={"Jana": "de"},
            lora_voices={"rosa": LoraVoice(path="/x", language="es-ES")},
        )
    )  # fmt: skip
    assert langs.checkpoint == ("fr", "de")
    assert langs.resolve(None, "pierre") == "fr"
    assert langs.resolve(None, "jana") == "de"
    assert langs.resolve(None, "ROSA") == "es"
    assert langs.resolve("it", "jana") == "it"
    assert langs.resolve("Auto", "jana") == "de"
    assert langs.all() == ("fr", "de", "es")
    with pytest.raises(APIError) as e:
        langs.resolve("xx", None, "language_code")
    assert e.value.status == 400 and e.value.param == "language_code"
    assert VoiceLanguages(_config()).resolve(None, "tara") == "en"
    # No voice: the default voice's language.
    jana = _config(voices=["pierre", "jana"], default_voice="jana", voice_languages={"jana": "de"})
    assert VoiceLanguages(jana).resolve(None, None) == "de"


def test_the_configuration_check_names_each_bad_language() -> None:
    cfg = _config(languages=["fr", "qq"], voice_languages={"a": "zz"})
    problems = language_problems(cfg)
    assert len(problems) == 2
    assert problems[0].startswith("llm.languages: unknown language 'qq'")
    assert problems[1].startswith("llm.voice_languages.a: unknown language 'zz'")


def _checkpoint(tmp_path: Path, orpheus: dict[str, object] | None, card: str | None) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"orpheus": orpheus} if orpheus else {}))
    if card is not None:
        (tmp_path / "README.md").write_text(card)
    return str(tmp_path)


def test_a_checkpoints_voices_and_languages_come_from_its_directory(tmp_path: Path) -> None:
    # Voices mapped to their languages in config.json.
    model = _checkpoint(tmp_path, {"voices": {"pierre": "fr", "jana": "de"}}, None)
    info = load_model_info(LLMConfig(model=model, default_voice="pierre"))
    assert info.voices == ("pierre", "jana")
    assert info.voice_languages == {"pierre": "fr", "jana": "de"}
    assert info.languages == ("fr", "de")


def test_a_model_cards_language_names_the_checkpoints(tmp_path: Path) -> None:
    card = "---\nlanguage:\n- fr\nlicense: apache-2.0\n---\n# Orpheus French\n"
    model = _checkpoint(tmp_path, {"voices": ["pierre", "amelie", "marie"]}, card)
    info = load_model_info(LLMConfig(model=model, default_voice="pierre"))
    assert info.languages == ("fr",) and info.voice_languages == {}
    card = "---\nlanguage: de\n---\n"
    (tmp_path / "README.md").write_text(card)
    assert load_model_info(LLMConfig(model=model, default_voice="pierre")).languages == ("de",)


def test_canopys_multilingual_checkpoints_need_no_voice_list(tmp_path: Path) -> None:
    """Canopy's research checkpoints ship no voice list; their model card names the
    language, and the voices of that release are known."""
    model = _checkpoint(tmp_path, None, "---\nlanguage:\n- fr\n---\n")
    info = load_model_info(LLMConfig(model=model, default_voice="pierre"))
    assert info.voices == ("pierre", "amelie", "marie") and info.languages == ("fr",)
    # The configuration's own list wins.
    info = load_model_info(
        LLMConfig(model=model, voices=["x"], default_voice="x", languages=["it"])
    )
    assert info.voices == ("x",) and info.languages == ("it",)
    # An English checkpoint with no card: the English voices, no language declared.
    (tmp_path / "en").mkdir()
    model = _checkpoint(tmp_path / "en", None, None)
    info = load_model_info(LLMConfig(model=model))
    assert info.voices[0] == "tara" and info.languages == ()


def test_held_open_text_in_a_language_without_spaces_is_released_per_sentence() -> None:
    held = HeldText(TextPlan((), True, "zh"))
    assert held.feed("今天是2024年") == ""
    assert held.feed("。我们有21") == "今天是二零二四年。"
    assert held.feed("个人！好") == "我们有二十一个人！"
    assert held.flush() == "好"
    # Latin text still holds its last words.
    held = HeldText(TextPlan((), True, "fr"))
    assert held.feed("Il a") == ""
    assert held.feed(" 21") == "Il "
    assert held.flush() == "a vingt et un"
