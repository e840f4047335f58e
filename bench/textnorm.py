"""``orpheus-serve bench textnorm [--json FILE]``: what the gateway's text work costs.

Times ``gateway.text`` in-process, per character of input and per sentence, on the gateway's
event-loop thread's terms (one core, no I/O):

- ``normalize`` (numbers spelled by ``num2words``, memoised; also timed with the memo
  cleared before each run) on plain sentences (the load corpus: nothing to rewrite, the quick check
  skips the scan) and on sentences dense with what it rewrites (numbers, currency, dates,
  times, phones, units, URLs, e-mail addresses, abbreviations);
- a dictionary plan (alias rules compiled into one regular expression) of 10, 100 and 1000
  rules on the corpus, and a 100-rule dictionary followed by normalisation (what a request
  with a locator and ``apply_text_normalization: on`` costs per unit).

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

from bench.report import environment, now_iso, show, table, write_json
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


def corpus() -> list[str]:
    text = resources.files("bench.load").joinpath("corpus/short.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def rules(n: int) -> list[AliasRule]:
    words = [f"Brand{i}x" for i in range(n - 1)] + ["Kubernetes"]
    return [AliasRule(string_to_replace=w, alias=f"alias {i}") for i, w in enumerate(words)]


def time_case(
    fn: Callable[[str], str], sentences: list[str], repeats: int, cold: bool = False
) -> dict[str, Any]:
    chars = sum(map(len, sentences))
    for s in sentences:  # warm: compile, num2words' imports
        fn(s)
    runs = []
    for _ in range(repeats):
        if cold:
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

    results = {
        name: time_case(fn, sents, args.repeats, cold="not cached" in name)
        for name, (fn, sents) in cases.items()
    }
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
    write_json(
        {
            "benchmark": "textnorm",
            "created": now_iso(),
            **environment({"loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}),
            "repeats": args.repeats,
            "results": results,
        },
        args.json,
        announce=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
