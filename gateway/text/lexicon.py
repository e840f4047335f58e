"""Pronunciation rules (ElevenLabs' shapes) and how a set of them rewrites text.

An ``alias`` rule replaces ``string_to_replace`` with ``alias`` (matched case-sensitively and
only as a whole word unless ``case_sensitive``/``word_boundaries`` say otherwise; both
default to true, as ElevenLabs'). A ``phoneme`` rule asks for a pronunciation in IPA or
CMU arpabet: Orpheus reads text, not phonemes, and no mapping from phonemes to an English
respelling is sound enough to promise the sound asked for, so phoneme rules are refused
when a dictionary is made or changed (``PhonemeRefused``), naming the rule.

A ``Lexicon`` is one dictionary version's rules compiled for one pass over the text, longer
strings first so that "Kubernetes cluster" wins over "Kubernetes".
"""

from __future__ import annotations

import re

import msgspec

MAX_RULE_CHARS = 512
"""Longest ``string_to_replace`` or ``alias``."""


class AliasRule(msgspec.Struct, frozen=True, kw_only=True, tag="alias", tag_field="type"):
    string_to_replace: str
    alias: str
    case_sensitive: bool | None = None
    word_boundaries: bool | None = None


class PhonemeRule(msgspec.Struct, frozen=True, kw_only=True, tag="phoneme", tag_field="type"):
    string_to_replace: str
    phoneme: str
    alphabet: str = "ipa"
    case_sensitive: bool | None = None
    word_boundaries: bool | None = None


Rule = AliasRule | PhonemeRule


class RuleError(ValueError):
    """A rule this server cannot take; the message names it."""


def phoneme_refusal(rule_name: str, phoneme: str, alphabet: str) -> str:
    return (
        f"rule for {rule_name!r}: phoneme rules ({alphabet} {phoneme!r}) are not supported: "
        "Orpheus reads text, not phonemes; use an alias rule with a respelling "
        '(e.g. {"type": "alias", "string_to_replace": "' + rule_name + '", "alias": "..."})'
    )


def check_rules(rules: list[Rule], max_rules: int) -> list[AliasRule]:
    """The alias rules of ``rules``; RuleError naming the first one refused."""
    if len(rules) > max_rules:
        raise RuleError(f"{len(rules)} rules; a dictionary holds at most {max_rules}")
    out: list[AliasRule] = []
    for r in rules:
        if isinstance(r, PhonemeRule):
            raise RuleError(phoneme_refusal(r.string_to_replace, r.phoneme, r.alphabet))
        if not r.string_to_replace.strip():
            raise RuleError("a rule's string_to_replace must contain some text")
        for field, value in (("string_to_replace", r.string_to_replace), ("alias", r.alias)):
            if len(value) > MAX_RULE_CHARS:
                raise RuleError(
                    f"rule for {r.string_to_replace[:40]!r}: {field} has {len(value)} "
                    f"characters; the limit is {MAX_RULE_CHARS}"
                )
            if "\x00" in value:
                raise RuleError(f"rule for {r.string_to_replace[:40]!r}: {field} contains NUL")
        out.append(r)
    return out


def _pattern(rule: AliasRule) -> str:
    body = re.escape(rule.string_to_replace)
    if rule.word_boundaries is not False:
        body = rf"(?<!\w){body}(?!\w)"
    if rule.case_sensitive is False:
        body = f"(?i:{body})"
    return body


_WORD = re.compile(r"\w+")


class Lexicon:
    """One dictionary version's rules, compiled.

    Whole-word rules (the default; a string that starts and ends with a letter or digit)
    are looked up by their first word: the text is scanned word by word and each word that
    starts a rule's string is tried against that word's rules, longest first, so the cost
    is per word of text, not per rule (a 1000-rule dictionary costs what a 10-rule one
    does: ``orpheus-serve bench textnorm``). The other rules (``word_boundaries: false``,
    strings that start or end with punctuation) are one regular expression, one named group
    per rule, applied first. For one string the first rule wins.
    """

    __slots__ = ("_aliases", "_by_word", "_regex", "max_words", "rules")

    def __init__(self, rules: list[AliasRule]) -> None:
        self.rules = rules
        self._by_word: dict[str, list[tuple[str, bool, str]]] = {}
        others: list[int] = []
        seen: set[tuple[str, bool]] = set()
        for i, r in enumerate(rules):
            s = r.string_to_replace
            cs = r.case_sensitive is not False
            key = (s if cs else s.lower(), cs)
            if key in seen:
                continue
            seen.add(key)
            first = _WORD.match(s)
            whole = (r.word_boundaries is not False and s[-1:].isalnum()) or s[-1:] == "_"
            if first is None or not whole:
                others.append(i)
                continue
            entry = (s if cs else s.lower(), cs, r.alias)
            self._by_word.setdefault(first.group().lower(), []).append(entry)
        for cands in self._by_word.values():
            cands.sort(key=lambda c: -len(c[0]))
        others.sort(key=lambda i: -len(rules[i].string_to_replace))
        self._aliases = [r.alias for r in rules]
        self._regex = (
            re.compile("|".join(f"(?P<r{i}>{_pattern(rules[i])})" for i in others))
            if others
            else None
        )
        self.max_words = max((len(r.string_to_replace.split()) for r in rules), default=0)
        """The most words one rule's string spans (how much a stream holds back)."""

    def apply(self, text: str) -> str:
        if self._regex is not None:
            aliases = self._aliases
            text = self._regex.sub(lambda m: aliases[int(m.lastgroup[1:])], text)  # type: ignore[index]
        by_word = self._by_word
        if not by_word:
            return text
        out: list[str] = []
        pos = 0
        n = len(text)
        for m in _WORD.finditer(text):
            start = m.start()
            if start < pos:
                continue  # inside a replaced string
            cands = by_word.get(m.group().lower())
            if cands is None:
                continue
            for s, cs, alias in cands:
                end = start + len(s)
                if end > n:
                    continue
                seg = text[start:end]
                if (seg == s if cs else seg.lower() == s) and (
                    end == n or not (text[end].isalnum() or text[end] == "_")
                ):
                    out.append(text[pos:start])
                    out.append(alias)
                    pos = end
                    break
        if not out:
            return text
        out.append(text[pos:])
        return "".join(out)
