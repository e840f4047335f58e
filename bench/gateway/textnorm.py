"""``orpheus-serve bench textnorm [--json FILE]``: what the gateway's text work costs.

Times ``gateway.text`` in-process, per character of input and per sentence, on the gateway's
event-loop thread's terms (one core, no I/O):

- ``normalize`` (numbers spelled by ``num2words``, memoised; also timed with the memo
  cleared before each run) on plain sentences (the load corpus: nothing to rewrite, the quick check
  skips the scan) and on sentences dense with what it rewrites (numbers, currency, dates,
  times, phones, units, URLs, e-mail addresses, abbreviations);
- a dictionary plan (alias rules compiled into one regular expression) of 10, 100 and 1000
  rules on the corpus, and a 100-rule dictionary followed by normalisation (what a request
  with a locator and ``apply_text_normalization: on`` costs per unit);
- each other language's normaliser (``gateway.text.intl``) on sentences of that language
  dense with numbers, currency, percentages, dates, times and ordinals, with its spelling
  memo warm and, built anew before each run, cold.

Each case runs ``--repeats`` times over its sentences; the median is reported. A sentence is
a unit the streaming protocols speak (``gateway.frontends.text_units``), so the per-sentence
time is what the gateway adds before a unit's request is submitted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from bench.lib.report import environment, now_iso, show, table, write_json
from gateway.text.intl import normalizer_for
from gateway.text.lexicon import AliasRule, Lexicon
from gateway.text.normalize import normalize, num2words
from gateway.text.plan import TextPlan

DENSE = [
    "Your total is $1,234.56, due on 2024-03-05 at 3:30 pm.",
    "Call (555) 123-4567 or +44 20 7946 0958 before 9:00.",
    "The 21st race is 10 km long and starts at 8:15 am on March 5, 2024.",
    "Growth was 12.5% in 1999, and €5 million in the 1990s.",
    "Dr. Smith vs. Mr. Jones: see https://example.com/docs or mail jane.doe@example.com.",
    "It weighs 5kg, runs at 3 GHz, and holds 512 GB at 20°C.",
    "Pages 10-20 cover items 1,001 to 2,500, etc.",
]


DENSE_BY_LANGUAGE = {
    "fr": [
        "Le 05/03/2024 à 14h05, 21 personnes ont payé 12,50 € chacune.",
        "La 1re édition a coûté 1 234,5 € et a grimpé de 3,5 % en 2023.",
        "Le 21e jour, 3 trains partent à 9h30 et 2 à 18h.",
    ],
    "de": [
        "Am 5. März 2024 um 14:05 zahlten 21 Leute je 12,50 €.",
        "Die Kosten stiegen um 3,5 % auf 1.234,5 € im Jahr 2023.",
        "Um 9:30 fahren 3 Züge, um 18:00 noch 2.",
    ],
    "es": [
        "El 05/03/2024 a las 14:05, 21 personas pagaron 12,50 € cada una.",
        "La 1ª edición costó 1.234,5 € y subió un 3,5 % en 2023.",
        "El 2º tren sale a las 9:30 y llegan 3 más.",
    ],
    "it": [
        "Il 05/03/2024 alle 14:05, 21 persone hanno pagato 12,50 € ciascuna.",
        "La 1ª edizione è costata 1.234,5 € ed è salita del 3,5 % nel 2023.",
        "Il 2º treno parte alle 9:30 e ne arrivano 3.",
    ],
    "pt": [
        "Em 05/03/2024 às 14:05, 21 pessoas pagaram R$ 12,50 cada.",
        "A 1ª edição custou 1.234,5 € e subiu 3,5 % em 2023.",
        "O 2º comboio parte às 9:30 e chegam mais 3.",
    ],
    "ko": [
        "2024-03-05 14:05에 21명이 각각 ₩12500을 냈다.",
        "비용은 2023년에 3.5% 올라 1,234.5달러가 되었다.",
        "9:30에 기차 3대가 출발하고 18:00에 2대가 더 간다.",
    ],
    "ja": [
        "2024-03-05の14:05に21人がそれぞれ¥1250を払った。",
        "費用は2023年に3.5%上がり1,234.5ドルになった。",
        "9:30に電車が3本出て、18:00にさらに2本出る。",
    ],
    "zh": [
        "2024年3月5日14:05，21个人每人付了￥12.5。",
        "费用在2023年上涨了3.5%，达到1,234.5元。",
        "第2列火车9:30出发，还有3列18:00出发。",
    ],
    "hi": [
        "05/03/2024 को 14:05 बजे 21 लोगों ने ₹12.50 दिए।",
        "लागत 2023 में 3.5% बढ़कर ₹1,234.5 हो गई।",
        "9:30 बजे 3 ट्रेनें चलती हैं और 18:00 बजे 2 और।",
    ],
}
"""Sentences dense with what each language's normaliser rewrites, one per line of work."""


def corpus() -> list[str]:
    text = resources.files("bench.load").joinpath("corpus/short.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def rules(n: int) -> list[AliasRule]:
    words = [f"Brand{i}x" for i in range(n - 1)] + ["Kubernetes"]
    return [AliasRule(string_to_replace=w, alias=f"alias {i}") for i, w in enumerate(words)]


def _fresh(language: str) -> Callable[[str], str]:
    """The language's normaliser built anew: its spelling memo empty."""
    normalizer_for.cache_clear()
    fn = normalizer_for(language)
    assert fn is not None
    return fn


def time_case(
    fn: Callable[[str], str], sentences: list[str], repeats: int, cold: bool = False,
    language: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    chars = sum(map(len, sentences))
    for s in sentences:  # warm: compile, num2words' imports
        fn(s)
    runs = []
    for _ in range(repeats):
        if cold and language is not None:
            fn = _fresh(language)  # every number spelled anew, as a first occurrence is
        elif cold:
            num2words.cache_clear()  # every number spelled anew, as a first occurrence is
        t0 = time.perf_counter_ns()
        for s in sentences:
            fn(s)
        runs.append(time.perf_counter_ns() - t0)
    med = statistics.median(runs)
    return {
        "sentences": len(sentences),
        "chars": chars,
        "ns_per_char": round(med / chars, 1),
        "us_per_sentence": round(med / len(sentences) / 1000, 2),
        "us_per_sentence_p90_run": round(
            sorted(runs)[int(0.9 * (len(runs) - 1))] / len(sentences) / 1000, 2
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orpheus-serve bench textnorm", description=__doc__)
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)

    plain = corpus()
    cases: dict[str, tuple[Callable[[str], str], list[str]]] = {
        "normalize, plain corpus": (normalize, plain),
        "normalize, dense sentences": (normalize, DENSE),
        "normalize, dense, numbers not cached": (normalize, DENSE),
    }
    for n in (10, 100, 1000):
        plan = TextPlan((Lexicon(rules(n)),), False)
        cases[f"dictionary of {n} rules, corpus"] = (plan.apply, plain)
    both = TextPlan((Lexicon(rules(100)),), True)
    cases["100 rules + normalize, dense"] = (both.apply, DENSE)
    languages: dict[str, str] = {}
    for lang, sents in DENSE_BY_LANGUAGE.items():
        fn = normalizer_for(lang)
        assert fn is not None
        for name in (f"normalize {lang}, dense", f"normalize {lang}, dense, numbers not cached"):
            cases[name] = (fn, sents)
            languages[name] = lang

    results = {
        name: time_case(
            fn, sents, args.repeats, cold="not cached" in name, language=languages.get(name)
        )
        for name, (fn, sents) in cases.items()
    }
    by_language = {
        lang: {
            "us_per_dense_sentence": results[f"normalize {lang}, dense"]["us_per_sentence"],
            "us_per_dense_sentence_cold": results[f"normalize {lang}, dense, numbers not cached"][
                "us_per_sentence"
            ],
        }
        for lang in DENSE_BY_LANGUAGE
    }
    by_language = {"en": {
        "us_per_dense_sentence": results["normalize, dense sentences"]["us_per_sentence"],
        "us_per_dense_sentence_cold": results["normalize, dense, numbers not cached"][
            "us_per_sentence"],
    }} | by_language  # fmt: skip
    rows = [
        [
            name,
            str(r["sentences"]),
            str(r["chars"]),
            f"{r['ns_per_char']:.0f}",
            f"{r['us_per_sentence']:.1f}",
            f"{r['us_per_sentence_p90_run']:.1f}",
        ]
        for name, r in results.items()
    ]
    show(
        table(
            f"gateway text work, median of {args.repeats} runs (one core, in-process)",
            ["case", "sentences", "chars", "ns/char", "µs/sentence", "p90 run µs/sentence"],
            rows,
            left={"case"},
        )
    )
    show(
        table(
            "µs per dense sentence, per language (target ≤ 100)",
            ["language", "memo warm", "memo cold", "≤ 100 µs"],
            [
                [
                    lang, f"{r['us_per_dense_sentence']:.1f}",
                    f"{r['us_per_dense_sentence_cold']:.1f}",
                    "yes" if r["us_per_dense_sentence"] <= 100 else "NO",
                ]
                for lang, r in by_language.items()
            ],
            left={"language"},
        )
    )  # fmt: skip
    write_json(
        {
            "benchmark": "textnorm",
            "created": now_iso(),
            **environment({"loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}),
            "repeats": args.repeats,
            "results": results,
            "by_language": by_language,
        },
        args.json,
        announce=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
