"""Text normalisation for the languages other than English: numbers, currency, percentages,
dates, times and ordinals written as the words a reader of *that* language says.

=========  ==========================  ==============================================
language   example                     spoken
=========  ==========================  ==============================================
fr         21, 3,5 %, 12,50 €          vingt et un, trois virgule cinq pour cent,
                                       douze euros et cinquante centimes
fr         1er, 14h05, 05/03/2024      premier, quatorze heures cinq, cinq mars deux
                                       mille vingt-quatre
de         1.234,5, 5. März 2024       eintausendzweihundertvierunddreißig Komma fünf,
                                       fünfte März zweitausendvierundzwanzig
es/it/pt   1º, 2ª, 14:05               primero, segunda, catorce y cinco
ko, ja     2024년, 3.5%                이천이십사년, 삼 점 오 퍼센트
zh         2024年3月5日, 15%, ￥30      二零二四年三月五日, 百分之十五, 三十元
hi         21, ₹5                      इक्कीस, पाँच रुपये
=========  ==========================  ==============================================

The spelling of numbers is a library's: ``num2words`` (fr, de, es, it, pt, nl, ko, ja and
the other languages it covers: cardinals and decimals only), ``indic_numtowords`` (Hindi),
``cn2an`` (Mandarin); this module only recognises what is a number of which kind, with the
language's decimal separator (``3,5`` is three and a half in French, ``1.234`` one thousand
two hundred and thirty-four in German). Emotion tags and other ``<...>`` tags, URLs and
e-mail addresses are left as written. A language with no spelling library has no
normaliser (``normalizer_for`` returns None): its text reaches the model unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, lru_cache

from num2words import CONVERTER_CLASSES
from num2words import num2words as _num2words

__all__ = ["LANGUAGES", "normalizer_for"]

Spell = Callable[[int], str]
DateFn = Callable[[int, int, "int | None"], str]
"""(day, month, year or None) in words."""
DateMaker = Callable[[Spell, Spell, tuple[str, ...]], DateFn]
"""(day speller, year speller, month names) -> a ``DateFn``."""
TimeFn = Callable[[int, int], str]
"""(hours, minutes) in words."""


@dataclass(frozen=True)
class Spec:
    """How one language writes and says numbers."""

    lang: str
    cardinal: Spell
    ordinal: Spell | None
    decimal_comma: bool
    """``3,5`` is a decimal (and ``1.234`` / ``1 234`` thousands); else ``3.5`` and ``1,234``."""
    point: str
    minus: str
    percent: Callable[[str], str]
    currency: dict[str, tuple[str, str]]
    """Symbol: (one, many); the amount is said before it."""
    cents: tuple[str, str, str] | None
    """(one, many, joiner): ``12,50 €`` -> "douze euros et cinquante centimes"."""
    months: tuple[str, ...]
    date: DateFn
    time: TimeFn
    year: Spell
    feminine: Callable[[str], str] | None = None
    """The feminine of an ordinal (``2ª`` -> "segunda")."""
    ordinal_suffix: str | None = None
    """A regex for what follows the digits of an ordinal (``er|e|ème`` in French)."""
    digit_sep: str = " "
    """Between the words of a decimal's digits."""
    time_suffix: str = ""
    """A regex for a word after a time that the time's words already say (Hindi's बजे)."""
    decimal: Callable[[str], str] | None = None
    """Says a decimal (``"3.5"``) itself; None: the whole part, ``point``, each digit."""
    extra: list[tuple[str, Callable[[re.Match[str]], str]]] = field(default_factory=list)


def _n2w(lang: str, to: str = "cardinal") -> Spell:
    @lru_cache(maxsize=2048)
    def spell(n: int) -> str:
        return str(_num2words(n, lang=lang, to=to))

    return spell


def _year_or_cardinal(lang: str) -> Spell:
    year, cardinal = _n2w(lang, "year"), _n2w(lang)

    def spell(n: int) -> str:
        try:
            return year(n)
        except (NotImplementedError, OverflowError, ValueError):
            return cardinal(n)

    return spell


def _o_to_a(words: str) -> str:
    return " ".join(w[:-1] + "a" if w.endswith("o") else w for w in words.split(" "))


def _plural(one: str, many: str, n: int) -> str:
    return one if n == 1 else many


# -- the languages -------------------------------------------------------------------------

_FR_MONTHS = tuple(
    "janvier février mars avril mai juin juillet août septembre octobre novembre décembre".split()
)
_DE_MONTHS = tuple(
    "Januar Februar März April Mai Juni Juli August September Oktober November Dezember".split()
)
_ES_MONTHS = tuple(
    "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre"
    .split()
)  # fmt: skip
_IT_MONTHS = tuple(
    "gennaio febbraio marzo aprile maggio giugno luglio agosto settembre ottobre novembre dicembre"
    .split()
)  # fmt: skip
_PT_MONTHS = tuple(
    "janeiro fevereiro março abril maio junho julho agosto setembro outubro novembro dezembro"
    .split()
)  # fmt: skip
_NL_MONTHS = tuple(
    "januari februari maart april mei juni juli augustus september oktober november december"
    .split()
)  # fmt: skip
_HI_MONTHS = tuple("जनवरी फ़रवरी मार्च अप्रैल मई जून जुलाई अगस्त सितंबर अक्टूबर नवंबर दिसंबर".split())


def _latin(
    lang: str,
    *,
    point: str,
    minus: str,
    percent: str,
    currency: dict[str, tuple[str, str]],
    cents: tuple[str, str, str] | None,
    months: tuple[str, ...],
    date: DateMaker,
    time: Callable[[Spell], TimeFn],
    ordinal_suffix: str | None,
    feminine: Callable[[str], str] | None = None,
    ordinal_day: bool = False,
) -> Spec:
    """A language ``num2words`` spells, written with a decimal comma."""
    cardinal, ordinal = _n2w(lang), _n2w(lang, "ordinal")
    year = _year_or_cardinal(lang)
    return Spec(
        lang=lang,
        cardinal=cardinal,
        ordinal=ordinal,
        decimal_comma=True,
        point=point,
        minus=minus,
        percent=lambda words: f"{words} {percent}",
        currency=currency,
        cents=cents,
        months=months,
        date=date(ordinal if ordinal_day else cardinal, year, months),
        time=time(cardinal),
        year=year,
        feminine=feminine,
        ordinal_suffix=ordinal_suffix,
    )


def _fr_date(day: Spell, year: Spell, months: tuple[str, ...]) -> DateFn:
    def say(d: int, m: int, y: int | None) -> str:
        out = f"{'premier' if d == 1 else day(d)} {months[m - 1]}"
        return f"{out} {year(y)}" if y is not None else out

    return say


def _day_month(day: Spell, year: Spell, months: tuple[str, ...]) -> DateFn:
    """``{day} {month} {year}`` (de with an ordinal day, nl with a cardinal one)."""

    def say(d: int, m: int, y: int | None) -> str:
        out = f"{day(d)} {months[m - 1]}"
        return f"{out} {year(y)}" if y is not None else out

    return say


def _of_date(of: str, first: str | None = None) -> DateMaker:
    """``d de mes de año`` (es, pt); ``first``: the word for day 1 (it: "primo")."""

    def make(day: Spell, year: Spell, months: tuple[str, ...]) -> DateFn:
        def say(d: int, m: int, y: int | None) -> str:
            words = first if (d == 1 and first) else day(d)
            out = f"{words}{of}{months[m - 1]}"
            return f"{out}{of}{year(y)}" if y is not None else out

        return say

    return make


def _time(hours: str | None, joiner: str, hour_one: str | None = None) -> Callable[[Spell], TimeFn]:
    """``14:05`` -> "{14} {hours} {joiner} {5}"; minutes 0 say only the hour."""

    def make(cardinal: Spell) -> TimeFn:
        def say(h: int, mi: int) -> str:
            unit = (hour_one if h == 1 and hour_one else hours) or ""
            out = f"{cardinal(h)} {unit}".rstrip()
            return out if mi == 0 else f"{out} {joiner} {cardinal(mi)}".replace("  ", " ")

        return say

    return make


_EURO_FR = {"€": ("euro", "euros"), "$": ("dollar", "dollars"), "£": ("livre", "livres")}

_SPECS: dict[str, Callable[[], Spec]] = {
    "fr": lambda: _latin(
        "fr", point="virgule", minus="moins", percent="pour cent",
        currency=_EURO_FR | {"¥": ("yen", "yens"), "₹": ("roupie", "roupies")},
        cents=("centime", "centimes", "et"), months=_FR_MONTHS, date=_fr_date,
        time=_time("heures", "", "heure"), ordinal_suffix=r"(?:er|re|ère|ème|e)",
    ),
    "de": lambda: _latin(
        "de", point="Komma", minus="minus", percent="Prozent",
        currency={"€": ("Euro", "Euro"), "$": ("Dollar", "Dollar"), "£": ("Pfund", "Pfund"),
                  "¥": ("Yen", "Yen"), "₹": ("Rupie", "Rupien")},
        cents=("Cent", "Cent", "und"), months=_DE_MONTHS, date=_day_month, ordinal_day=True,
        time=_time("Uhr", ""), ordinal_suffix=None,
    ),
    "es": lambda: _latin(
        "es", point="coma", minus="menos", percent="por ciento",
        currency={"€": ("euro", "euros"), "$": ("dólar", "dólares"), "£": ("libra", "libras"),
                  "¥": ("yen", "yenes"), "₹": ("rupia", "rupias")},
        cents=("céntimo", "céntimos", "con"), months=_ES_MONTHS, date=_of_date(" de "),
        time=_time(None, "y"), ordinal_suffix=r"[ºª°]", feminine=_o_to_a,
    ),
    "it": lambda: _latin(
        "it", point="virgola", minus="meno", percent="per cento",
        currency={"€": ("euro", "euro"), "$": ("dollaro", "dollari"), "£": ("sterlina", "sterline"),
                  "¥": ("yen", "yen"), "₹": ("rupia", "rupie")},
        cents=("centesimo", "centesimi", "e"), months=_IT_MONTHS, date=_of_date(" ", "primo"),
        time=_time(None, "e"), ordinal_suffix=r"[ºª°]", feminine=_o_to_a,
    ),
    "pt": lambda: _latin(
        "pt", point="vírgula", minus="menos", percent="por cento",
        currency={"€": ("euro", "euros"), "$": ("dólar", "dólares"), "£": ("libra", "libras"),
                  "¥": ("iene", "ienes"), "₹": ("rupia", "rupias"), "R$": ("real", "reais")},
        cents=("cêntimo", "cêntimos", "e"), months=_PT_MONTHS, date=_of_date(" de "),
        time=_time("horas", "e", "hora"), ordinal_suffix=r"[ºª°]", feminine=_o_to_a,
    ),
    "nl": lambda: _latin(
        "nl", point="komma", minus="min", percent="procent",
        currency={"€": ("euro", "euro"), "$": ("dollar", "dollar"), "£": ("pond", "pond")},
        cents=("cent", "cent", "en"), months=_NL_MONTHS, date=_day_month,
        time=_time("uur", ""), ordinal_suffix=r"(?:ste|de|e)",
    ),
}  # fmt: skip


def _digits(spell: Spell, s: str, sep: str) -> str:
    return sep.join(spell(int(d)) for d in s)


def _ko() -> Spec:
    cardinal = _n2w("ko")
    return Spec(
        lang="ko", cardinal=cardinal, ordinal=None, decimal_comma=False, point="점", minus="마이너스",
        percent=lambda w: f"{w} 퍼센트",
        currency={"₩": ("원", "원"), "$": ("달러", "달러"), "€": ("유로", "유로"),
                  "¥": ("엔", "엔"), "£": ("파운드", "파운드")},
        cents=None, months=(),
        date=lambda d, m, y: (f"{cardinal(y)}년 " if y else "") + f"{cardinal(m)}월 {cardinal(d)}일",
        time=lambda h, mi: f"{cardinal(h)}시" + (f" {cardinal(mi)}분" if mi else ""),
        year=cardinal,
    )  # fmt: skip


def _ja() -> Spec:
    cardinal = _n2w("ja")
    return Spec(
        lang="ja", cardinal=cardinal, ordinal=None, decimal_comma=False, point="点",
        minus="マイナス",
        percent=lambda w: f"{w}パーセント",
        currency={"¥": ("円", "円"), "￥": ("円", "円"), "$": ("ドル", "ドル"),
                  "€": ("ユーロ", "ユーロ"), "£": ("ポンド", "ポンド")},
        cents=None, months=(),
        date=lambda d, m, y: (f"{cardinal(y)}年" if y else "") + f"{cardinal(m)}月{cardinal(d)}日",
        time=lambda h, mi: f"{cardinal(h)}時" + (f"{cardinal(mi)}分" if mi else ""),
        year=cardinal, digit_sep="",
    )  # fmt: skip


def _zh() -> Spec:
    from cn2an import an2cn

    @lru_cache(maxsize=2048)
    def cardinal(n: int) -> str:
        return str(an2cn(str(n)))

    digits = "零一二三四五六七八九"

    def year(n: int) -> str:
        return "".join(digits[int(d)] for d in str(n))

    return Spec(
        lang="zh", cardinal=cardinal, ordinal=None, decimal_comma=False, point="点", minus="负",
        percent=lambda w: f"百分之{w}",
        currency={"¥": ("元", "元"), "￥": ("元", "元"), "$": ("美元", "美元"),
                  "€": ("欧元", "欧元"), "£": ("英镑", "英镑"), "₹": ("卢比", "卢比")},
        cents=None, months=(),
        date=lambda d, m, y: (f"{year(y)}年" if y else "") + f"{cardinal(m)}月{cardinal(d)}日",
        time=lambda h, mi: f"{cardinal(h)}点"
        + (f"{'零' if mi < 10 else ''}{cardinal(mi)}分" if mi else ""),
        year=year, digit_sep="",
        extra=[(r"(?<![0-9])(?P<zy>\d{4})(?=年)", lambda m: year(int(m["zy"])))],
    )  # fmt: skip


def _hi() -> Spec:
    from indic_numtowords import num2words as indic

    @lru_cache(maxsize=2048)
    def cardinal(n: int) -> str:
        return str(indic(n, lang="hi"))

    return Spec(
        lang="hi", cardinal=cardinal, ordinal=None, decimal_comma=False, point="दशमलव", minus="ऋण",
        percent=lambda w: f"{w} प्रतिशत",
        currency={"₹": ("रुपया", "रुपये"), "$": ("डॉलर", "डॉलर"), "€": ("यूरो", "यूरो"),
                  "£": ("पाउंड", "पाउंड")},
        cents=("पैसा", "पैसे", "और"), months=_HI_MONTHS,
        date=lambda d, m, y: f"{cardinal(d)} {_HI_MONTHS[m - 1]}" + (f" {cardinal(y)}" if y else ""),
        time=lambda h, mi: f"{cardinal(h)} बजकर {cardinal(mi)} मिनट" if mi else f"{cardinal(h)} बजे",
        year=cardinal, time_suffix=r"(?:\s?बजे(?!\w))?",
    )  # fmt: skip


_SPECS |= {"ko": _ko, "ja": _ja, "zh": _zh, "hi": _hi}


def _generic(lang: str) -> Callable[[], Spec]:
    """A language ``num2words`` spells and this module has no table for: cardinals and
    decimals only (no currency, dates or times: left as written)."""

    def make() -> Spec:
        cardinal = _n2w(lang)
        comma = lang not in ("he", "th", "ja", "ko")
        return Spec(
            lang=lang, cardinal=cardinal, ordinal=None, decimal_comma=comma,
            point="," if comma else ".", minus="-", percent=lambda w: f"{w} %",
            decimal=lambda s: str(_num2words(float(s), lang=lang)), currency={}, cents=None, months=(),
            date=lambda d, m, y: "", time=lambda h, mi: "", year=cardinal,
        )  # fmt: skip

    return make


# -- the scanner ---------------------------------------------------------------------------

_DIGIT_RUN = re.compile(r"\d+")
_B = "0-9A-Za-zÀ-ÖØ-öø-ÿ_"
"""What may not touch a number on either side ("MP3", "3D" stay as written)."""


class _Normalizer:
    """One compiled alternation per language, scanned once left to right."""

    def __init__(self, spec: Spec) -> None:
        self.spec = s = spec
        if s.decimal_comma:
            num = r"\d{1,3}(?:[.\u00a0\u202f ]\d{3})+(?![\d])(?:,\d+)?|\d+(?:[,.]\d+)?"
        else:
            num = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
        cur = "|".join(re.escape(c) for c in sorted(s.currency, key=len, reverse=True)) or "(?!)"
        months = "|".join(re.escape(m) for m in s.months) or "(?!)"
        parts: list[tuple[str, str, Callable[[re.Match[str]], str]]] = [
            ("tag", r"<[A-Za-z_][\w-]{0,31}>", lambda m: m.group()),
            ("url", r"\b(?:https?://|www\.)[^\s<>\"]+|\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+",
             lambda m: m.group()),
            *[(f"x{i}", rx, fn) for i, (rx, fn) in enumerate(s.extra)],
            ("cur1", rf"(?P<c1>{cur})\s?(?P<a1>-?(?:{num}))(?![{_B}])", self._currency),
            ("cur2", rf"(?<![{_B}])(?P<a2>-?(?:{num}))\s?(?P<c2>{cur})", self._currency),
            ("pct", rf"(?<![{_B}])(?P<p>-?(?:{num}))\s?%", self._percent),
            ("iso", r"(?<![\d.])(?P<iy>\d{4})-(?P<im>\d{2})-(?P<id>\d{2})(?![\d])", self._iso),
            ("dmy", r"(?<![\d./])(?P<dd>\d{1,2})[./](?P<dm>\d{1,2})[./](?P<dy>\d{4})(?![\d])",
             self._dmy),
            ("dmon", rf"(?<![{_B}])(?P<md>\d{{1,2}})\.?\s(?P<mm>{months})(?:\s(?P<my>\d{{4}}))?\b",
             self._day_month),
            ("time", r"(?<![\d.:])(?P<h>\d{1,2})" + (r"(?::|h)" if s.lang == "fr" else ":")
             + r"(?P<mi>\d{2})(?![\d:])" + s.time_suffix
             + (r"|(?<![\d.:])(?P<h2>\d{1,2})h(?![\w])" if s.lang == "fr" else ""), self._time),
            ("ord", rf"(?<![{_B}])(?P<o>\d+)(?P<os>{s.ordinal_suffix})(?![{_B}])"
             if s.ordinal_suffix and s.ordinal else "(?!)", self._ordinal),
            ("num", rf"(?<![{_B}])(?P<n>-?(?:{num}))(?![{_B}])", self._number),
        ]  # fmt: skip
        self._rewrite = {f"_{name}": fn for name, _, fn in parts}
        self._pattern = re.compile("|".join(f"(?P<_{name}>{rx})" for name, rx, _ in parts))
        self._quick = re.compile(r"\d")

    # -- spelling --------------------------------------------------------------------------
    def _split(self, s: str) -> tuple[bool, str, str]:
        """(negative, whole digits, fraction digits) of a number as written."""
        neg = s.startswith("-")
        s = s.lstrip("-")
        if self.spec.decimal_comma:
            if "," in s:
                whole, frac = s.split(",", 1)
            elif re.fullmatch(r"\d{1,3}(?:\.\d{3})+", s):
                whole, frac = s, ""
            else:
                whole, _, frac = s.partition(".")
            whole = re.sub(r"[.\u00a0\u202f ]", "", whole)
        else:
            whole, _, frac = s.replace(",", "").partition(".")
        return neg, whole, frac

    def number(self, s: str) -> str:
        spec = self.spec
        neg, whole, frac = self._split(s)
        if len(whole) > 1 and whole.startswith("0") and not frac:
            words = _digits(spec.cardinal, whole, spec.digit_sep)  # "007": an identifier
        else:
            words = spec.cardinal(int(whole or "0"))
        if frac and spec.decimal is not None:
            words = spec.decimal(f"{whole or '0'}.{frac}")
        elif frac:
            sep = spec.digit_sep
            words = (
                f"{words}{sep or ' '}{spec.point}{sep or ' '}{_digits(spec.cardinal, frac, sep)}"
            )
            if not sep:
                words = words.replace(" ", "")
        return f"{spec.minus} {words}" if neg else words

    def _number(self, m: re.Match[str]) -> str:
        return self.number(m["n"])

    def _percent(self, m: re.Match[str]) -> str:
        return self.spec.percent(self.number(m["p"]))

    def _currency(self, m: re.Match[str]) -> str:
        spec = self.spec
        symbol, amount = (m["c1"], m["a1"]) if m["c1"] else (m["c2"], m["a2"])
        one, many = spec.currency[symbol]
        neg, whole, frac = self._split(amount)
        n = int(whole or "0")
        sep = spec.digit_sep
        if spec.cents is not None and frac and len(frac) <= 2:
            c = int(frac.ljust(2, "0"))
            words = f"{spec.cardinal(n)} {_plural(one, many, n)}"
            if c:
                c_one, c_many, joiner = spec.cents
                words += f" {joiner} {spec.cardinal(c)} {_plural(c_one, c_many, c)}"
        else:
            words = f"{self.number(amount.lstrip('-'))}{sep and ' '}{_plural(one, many, n)}"
        return f"{spec.minus} {words}" if neg else words

    def _date(self, d: int, mo: int, y: int | None, raw: str) -> str:
        if not (1 <= mo <= 12 and 1 <= d <= 31):
            return raw
        return self.spec.date(d, mo, y) or raw

    def _iso(self, m: re.Match[str]) -> str:
        return self._date(int(m["id"]), int(m["im"]), int(m["iy"]), m.group())

    def _dmy(self, m: re.Match[str]) -> str:
        return self._date(int(m["dd"]), int(m["dm"]), int(m["dy"]), m.group())

    def _day_month(self, m: re.Match[str]) -> str:
        mo = self.spec.months.index(m["mm"]) + 1
        y = int(m["my"]) if m["my"] else None
        return self._date(int(m["md"]), mo, y, m.group())

    def _time(self, m: re.Match[str]) -> str:
        h = int(m["h"] if m["h"] is not None else m["h2"])
        mi = int(m["mi"]) if m["mi"] is not None else 0
        if h > 24 or mi > 59:
            return m.group()
        return self.spec.time(h, mi) or m.group()

    def _ordinal(self, m: re.Match[str]) -> str:
        spec = self.spec
        assert spec.ordinal is not None
        n = int(m["o"])
        suffix = m["os"]
        if spec.lang == "fr":  # French: 1er / 1re, every other ordinal is "-ième"
            if n == 1:
                return "première" if suffix in ("re", "ère") else "premier"
            if suffix in ("er", "re"):
                return m.group()  # "2er": not an ordinal
        words = spec.ordinal(n)
        if suffix == "ª" and spec.feminine is not None:
            words = spec.feminine(words)
        return words

    def _sub(self, m: re.Match[str]) -> str:
        try:
            return self._rewrite[m.lastgroup](m)  # type: ignore[index]
        except (ValueError, TypeError, OverflowError, NotImplementedError, IndexError, KeyError):
            # Past what the library spells (cn2an: 16 digits; indic_numtowords: 9): the
            # digits one by one, still in the language.
            spec = self.spec
            return _DIGIT_RUN.sub(
                lambda d: _digits(spec.cardinal, d.group(), spec.digit_sep), m.group()
            )

    def __call__(self, text: str) -> str:
        if not self._quick.search(text):
            return text
        return self._pattern.sub(self._sub, text)


LANGUAGES: frozenset[str] = frozenset(
    {*_SPECS, *(c for c in CONVERTER_CLASSES if len(c) == 2 and c != "en")}
)
"""The languages other than English with a normaliser."""


@cache
def normalizer_for(language: str) -> Callable[[str], str] | None:
    """The normaliser of ``language`` (an ISO 639-1 code, not English); None where none
    exists: such text goes to the model as written."""
    make = _SPECS.get(language)
    if make is None:
        if language not in LANGUAGES:
            return None
        make = _generic(language)
    return _Normalizer(make())
