"""English text normalisation: what is written becomes what is said, before the model sees it.

Orpheus was trained on transcripts of speech, so "$3.50", "21st", "3:30 pm", "10 km" or
"jane@example.com" are read badly or not at all. ``normalize`` rewrites them as words:

==============  =====================  =================================================
category        example                spoken
==============  =====================  =================================================
currency        $3.50, €5 million      three dollars and fifty cents, five million euros
percentage      12.5%                  twelve point five percent
date            2024-03-05, 3/5/2024   March fifth, twenty twenty-four
                March 5, 2024          March fifth, twenty twenty-four
time            3:30 pm, 14:05         three thirty p m, fourteen oh five
phone number    (555) 123-4567         five five five, one two three, four five six seven
unit            10 km, 5kg, 20°C       ten kilometers, five kilograms, twenty degrees Celsius
ordinal         21st                   twenty-first
year            in 1999                nineteen ninety-nine
number          1,234.5, -3            one thousand, two hundred and thirty-four point five
abbreviation    Dr. Smith, etc.        Doctor Smith, et cetera
URL             https://example.com/a  example dot com slash a
e-mail          jane.doe@example.com   jane dot doe at example dot com
==============  =====================  =================================================

The spelling of numbers (cardinals, ordinals, years, decimals) is ``num2words``'; this module
only recognises what is a number of which kind. Emotion tags (``<laugh>``, ``<sigh>``...) and
any other ``<...>`` tag pass through untouched.

One compiled alternation scans the text once, left to right; each match is rewritten by its
category's function. The cost per character is measured by ``orpheus-serve bench textnorm``
(docs/results/textnorm.json).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

from num2words import num2words as _num2words

__all__ = ["normalize"]

_DIGIT_WORDS = "zero one two three four five six seven eight nine".split()
_MONTHS = (
    "January February March April May June July August September October November December"
).split()
_MONTH_BY_NAME = {m.lower(): i + 1 for i, m in enumerate(_MONTHS)}
_MONTH_BY_NAME.update({m[:3].lower(): i + 1 for i, m in enumerate(_MONTHS)})
_MONTH_BY_NAME["sept"] = 9

_CURRENCIES = {
    # symbol: (singular, plural, cent singular, cent plural)
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", "sen", "sen"),
    "₹": ("rupee", "rupees", "paisa", "paise"),
}
_SCALES = {
    "k": "thousand",
    "thousand": "thousand",
    "m": "million",
    "mn": "million",
    "million": "million",
    "b": "billion",
    "bn": "billion",
    "billion": "billion",
    "t": "trillion",
    "tn": "trillion",
    "trillion": "trillion",
}

_UNITS = {
    # abbreviation (case-sensitive): (singular, plural)
    "km": ("kilometer", "kilometers"),
    "m": ("meter", "meters"),
    "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"),
    "mi": ("mile", "miles"),
    "ft": ("foot", "feet"),
    "kg": ("kilogram", "kilograms"),
    "g": ("gram", "grams"),
    "mg": ("milligram", "milligrams"),
    "lb": ("pound", "pounds"),
    "lbs": ("pound", "pounds"),
    "oz": ("ounce", "ounces"),
    "l": ("liter", "liters"),
    "L": ("liter", "liters"),
    "ml": ("milliliter", "milliliters"),
    "mL": ("milliliter", "milliliters"),
    "mph": ("mile per hour", "miles per hour"),
    "km/h": ("kilometer per hour", "kilometers per hour"),
    "kph": ("kilometer per hour", "kilometers per hour"),
    "ms": ("millisecond", "milliseconds"),
    "sec": ("second", "seconds"),
    "min": ("minute", "minutes"),
    "h": ("hour", "hours"),
    "hr": ("hour", "hours"),
    "hrs": ("hour", "hours"),
    "Hz": ("hertz", "hertz"),
    "kHz": ("kilohertz", "kilohertz"),
    "MHz": ("megahertz", "megahertz"),
    "GHz": ("gigahertz", "gigahertz"),
    "KB": ("kilobyte", "kilobytes"),
    "kB": ("kilobyte", "kilobytes"),
    "MB": ("megabyte", "megabytes"),
    "GB": ("gigabyte", "gigabytes"),
    "TB": ("terabyte", "terabytes"),
    "W": ("watt", "watts"),
    "kW": ("kilowatt", "kilowatts"),
    "kWh": ("kilowatt hour", "kilowatt hours"),
    "V": ("volt", "volts"),
    "°C": ("degree Celsius", "degrees Celsius"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "°": ("degree", "degrees"),
}

_ABBREVIATIONS = {
    # written (case-sensitive, with its period): spoken
    "Mr.": "Mister",
    "Mrs.": "Missus",
    "Ms.": "Miz",
    "Dr.": "Doctor",
    "Prof.": "Professor",
    "Sr.": "Senior",
    "Jr.": "Junior",
    "St.": "Saint",
    "Mt.": "Mount",
    "Ave.": "Avenue",
    "Blvd.": "Boulevard",
    "Rd.": "Road",
    "Dept.": "Department",
    "Inc.": "Incorporated",
    "Ltd.": "Limited",
    "Co.": "Company",
    "Corp.": "Corporation",
    "vs.": "versus",
    "etc.": "et cetera",
    "e.g.": "for example",
    "i.e.": "that is",
    "approx.": "approximately",
    "No.": "number",
    "Jan.": "January",
    "Feb.": "February",
    "Aug.": "August",
    "Sept.": "September",
    "Oct.": "October",
    "Nov.": "November",
    "Dec.": "December",
}

_SYMBOL_WORDS = {
    ".": "dot",
    "/": "slash",
    "-": "dash",
    "_": "underscore",
    ":": "colon",
    "?": "question mark",
    "=": "equals",
    "&": "and",
    "#": "hash",
    "+": "plus",
    "~": "tilde",
    "%": "percent",
    "@": "at",
}


# -- spelling helpers --------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def num2words(n: int, to: str = "cardinal") -> str:
    """``num2words``' English words for ``n`` (memoised: the same numbers come back often)."""
    return str(_num2words(n, to=to))


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def cardinal(s: str) -> str:
    """``s`` (digits, thousands commas, an optional decimal part and sign) in words."""
    s = s.replace(",", "")
    neg = s.startswith(("-", "−"))
    s = s.lstrip("-−+")
    if "." in s:
        whole, frac = s.split(".", 1)
        words = num2words(int(whole or "0"))
        if frac:
            words += " point " + " ".join(_DIGIT_WORDS[int(d)] for d in frac)
    elif len(s) > 1 and s.startswith("0"):
        words = digits(s)  # "007": an identifier, read digit by digit
    else:
        words = num2words(int(s))
    return f"minus {words}" if neg else words


def digits(s: str) -> str:
    return " ".join(_DIGIT_WORDS[int(d)] for d in s if d.isdigit())


def year(n: int) -> str:
    return num2words(n, to="year")


def ordinal(n: int) -> str:
    return num2words(n, to="ordinal")


def _spell_symbols(s: str) -> str:
    """A URL or an address: its punctuation as words, digit runs digit by digit."""
    out: list[str] = []
    for tok in re.findall(r"[A-Za-z]+|\d+|.", s):
        if tok.isdigit():
            out.append(digits(tok) if len(tok) > 1 else _DIGIT_WORDS[int(tok)])
        elif tok.isalpha():
            out.append(tok.lower() if tok.isupper() and len(tok) > 3 else tok)
        elif tok in _SYMBOL_WORDS:
            out.append(_SYMBOL_WORDS[tok])
    return " ".join(out)


# -- categories: (pattern, rewrite) ------------------------------------------------------------

_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"


def _tag(m: re.Match[str]) -> str:
    return m.group()


def _url(m: re.Match[str]) -> str:
    url = m.group()
    trail = ""
    while url and url[-1] in ".,;:!?)":
        trail = url[-1] + trail
        url = url[:-1]
    url = re.sub(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", "", url)
    return _spell_symbols(url.rstrip("/")) + trail


def _email(m: re.Match[str]) -> str:
    return _spell_symbols(m.group())


def _phone(m: re.Match[str]) -> str:
    groups = [g for g in re.split(r"[^\d+]+", m.group()) if g]
    out = []
    for g in groups:
        if g.startswith("+"):
            out.append("plus " + digits(g))
        else:
            out.append(digits(g))
    return ", ".join(out)


def _currency(m: re.Match[str]) -> str:
    one, many, cent_one, cent_many = _CURRENCIES[m["cur"]]
    amount = m["amt"].replace(",", "")
    scale = m["scale"]
    if scale:
        return f"{cardinal(amount)} {_SCALES[scale.lower()]} {many}"
    whole, _, frac = amount.partition(".")
    n = int(whole or "0")
    words = f"{num2words(n)} {one if n == 1 else many}"
    if frac and len(frac) <= 2 and int(frac) > 0:
        c = int(frac.ljust(2, "0"))
        cents = f"{num2words(c)} {cent_one if c == 1 else cent_many}"
        return cents if n == 0 else f"{words} and {cents}"
    if frac and len(frac) > 2:
        return f"{cardinal(amount)} {many}"
    return words


def _percent(m: re.Match[str]) -> str:
    return f"{cardinal(m['pct'])} percent"


def _iso_date(m: re.Match[str]) -> str:
    y, mo, d = int(m["y"]), int(m["mo"]), int(m["d"])
    if not (1 <= mo <= 12 and 1 <= d <= 31):
        return " to ".join(cardinal(p) for p in m.group().split("-"))
    return f"{_MONTHS[mo - 1]} {ordinal(d)}, {year(y)}"


def _slash_date(m: re.Match[str]) -> str:
    mo, d, y = int(m["smo"]), int(m["sd"]), m["sy"]
    if not (1 <= mo <= 12 and 1 <= d <= 31):  # not month/day (US order): read the parts
        return " slash ".join(cardinal(p) for p in m.group().split("/"))
    yy = int(y)
    if len(y) == 2:
        yy += 2000 if yy < 50 else 1900
    return f"{_MONTHS[mo - 1]} {ordinal(d)}, {year(yy)}"


def _month_day(m: re.Match[str]) -> str:
    month = _MONTHS[_MONTH_BY_NAME[m["mon"].lower().rstrip(".")] - 1]
    out = f"{month} {ordinal(int(m['day']))}"
    if m["yr"]:
        out += f", {year(int(m['yr']))}"
    return out


def _day_month(m: re.Match[str]) -> str:
    month = _MONTHS[_MONTH_BY_NAME[m["mon2"].lower().rstrip(".")] - 1]
    out = f"the {ordinal(int(m['day2']))} of {month}"
    if m["yr2"]:
        out += f" {year(int(m['yr2']))}"
    return out


def _time(m: re.Match[str]) -> str:
    h, mi = int(m["h"]), int(m["mi"])
    if h > 24 or mi > 59:
        return " ".join(cardinal(p) for p in m.group().split(":"))
    ampm = m["ampm"]
    hour = num2words(h)
    if mi == 0:
        words = hour if ampm else f"{hour} o'clock" if h <= 12 else f"{hour} hundred"
    elif mi < 10:
        words = f"{hour} oh {num2words(mi)}"
    else:
        words = f"{hour} {num2words(mi)}"
    if ampm:
        words += " " + " ".join(c for c in ampm.lower() if c.isalpha())
        after = m.string[m.end() :].lstrip()
        if ampm.endswith(".") and (not after or after[0].isupper()):
            words += "."  # "p.m." ended the sentence too
    return words


def _unit(m: re.Match[str]) -> str:
    one, many = _UNITS[m["unit"]]
    n = m["un"]
    return f"{cardinal(n)} {one if n.replace(',', '') in ('1', '1.0') else many}"


def _ordinal(m: re.Match[str]) -> str:
    return ordinal(_int(m["ord"]))


def _year(m: re.Match[str]) -> str:
    return year(int(m["yr3"]))


def _decade(m: re.Match[str]) -> str:
    words = year(int(m["dec"]))  # "nineteen eighty"
    if words.endswith("y"):
        return words[:-1] + "ies"
    return words + "s"


def _range(m: re.Match[str]) -> str:
    return f"{cardinal(m['r1'])} to {cardinal(m['r2'])}"


def _number(m: re.Match[str]) -> str:
    return cardinal(m.group())


_SENTENCE_FINAL = frozenset({"etc.", "Inc.", "Ltd.", "Co.", "Corp.", "Jr.", "Sr."})
"""Abbreviations that often end a sentence: their period stays when it does."""


def _abbreviation(m: re.Match[str]) -> str:
    written = m.group()
    spoken = _ABBREVIATIONS[written]
    if written in _SENTENCE_FINAL:
        after = m.string[m.end() :].lstrip()
        if not after or after[0].isupper():
            spoken += "."
    return spoken


def _amp(m: re.Match[str]) -> str:
    return " and "


_MONTH_NAMES = "|".join(
    sorted({*(m for m in _MONTHS), *(m[:3] + r"\.?" for m in _MONTHS), r"Sept\.?"}, key=len)[::-1]
)
_UNIT_NAMES = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
_ABBR_NAMES = "|".join(re.escape(a) for a in sorted(_ABBREVIATIONS, key=len, reverse=True))
_CUR_SYMBOLS = "".join(re.escape(c) for c in _CURRENCIES)
_SCALE_NAMES = "|".join(sorted(_SCALES, key=len, reverse=True))

# Order matters: the first alternative that matches at a position wins.
_CATEGORIES: list[tuple[str, str, Callable[[re.Match[str]], str]]] = [
    ("tag", r"<[A-Za-z_][\w-]{0,31}>", _tag),
    ("url", r"\b(?:https?://|www\.)[^\s<>\"]+", _url),
    ("email", r"\b[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\b", _email),
    (
        "phone",
        r"(?<![\w.])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{3}\)\s?|\d{3}[\s.-])\d{3}[\s.-]\d{4}(?![\w])"
        r"|(?<![\w.])\+\d{1,3}(?:[\s.-]\d{2,4}){2,4}(?![\w])",
        _phone,
    ),
    (
        "currency",
        rf"(?P<cur>[{_CUR_SYMBOLS}])\s?(?P<amt>{_NUM})(?:\s?(?P<scale>(?:{_SCALE_NAMES})\b))?",
        _currency,
    ),
    ("percent", rf"(?P<pct>-?(?:{_NUM}))\s?%", _percent),
    ("iso_date", r"\b(?P<y>\d{4})-(?P<mo>\d{2})-(?P<d>\d{2})\b", _iso_date),
    ("slash_date", r"\b(?P<smo>\d{1,2})/(?P<sd>\d{1,2})/(?P<sy>\d{4}|\d{2})\b", _slash_date),
    (
        "month_day",
        rf"\b(?P<mon>{_MONTH_NAMES})\s(?P<day>\d{{1,2}})(?:st|nd|rd|th)?\b"
        r"(?:,?\s(?P<yr>\d{4})\b)?",
        _month_day,
    ),
    (
        "day_month",
        rf"\b(?P<day2>\d{{1,2}})(?:st|nd|rd|th)?\s(?:of\s)?(?P<mon2>{_MONTH_NAMES})\b"
        r"(?:,?\s(?P<yr2>\d{4})\b)?",
        _day_month,
    ),
    (
        "time",
        r"\b(?P<h>\d{1,2}):(?P<mi>\d{2})(?::\d{2})?(?:\s?(?P<ampm>[AaPp](?:\.[Mm]\.|[Mm]))(?!\w))?",
        _time,
    ),
    ("unit", rf"(?P<un>-?(?:{_NUM}))\s?(?P<unit>{_UNIT_NAMES})(?![\w°])", _unit),
    ("ordinal", r"\b(?P<ord>\d{1,3}(?:,\d{3})*|\d+)(?:st|nd|rd|th)\b", _ordinal),
    ("decade", r"\b(?P<dec>1[1-9]\d0|20[0-9]0)'?s\b", _decade),
    ("range", rf"(?<![\w-])(?P<r1>{_NUM})\s?[-–](?=\d)(?P<r2>{_NUM})\b", _range),
    ("year", r"(?<![\w.,-])(?P<yr3>1[1-9]\d\d|20\d\d)(?![\w.,]\d|\w)", _year),
    ("number", rf"(?<![\w.])[-−]?(?:{_NUM})(?![\w])", _number),
    ("abbr", rf"(?<![\w.])(?:{_ABBR_NAMES})(?!\w)", _abbreviation),
    ("amp", r"\s&\s", _amp),
]

_PATTERN = re.compile("|".join(f"(?P<_{name}>{rx})" for name, rx, _ in _CATEGORIES))
_REWRITE = {f"_{name}": fn for name, _, fn in _CATEGORIES}
_QUICK = re.compile(r"[\d<@&$€£¥₹]|www\.|://|\b(?:" + _ABBR_NAMES + ")")
"""Text with none of these has nothing to normalise: most sentences skip the scan."""


def _rewrite(m: re.Match[str]) -> str:
    # The category's group encloses its inner groups, so it is the last to close: lastgroup.
    return _REWRITE[m.lastgroup](m)  # type: ignore[index]


def normalize(text: str) -> str:
    """``text`` with numbers, dates, times, currency, units, abbreviations, URLs and e-mail
    addresses written as the words a reader would say (English); tags pass through."""
    if not _QUICK.search(text):
        return text
    return _PATTERN.sub(_rewrite, text)
