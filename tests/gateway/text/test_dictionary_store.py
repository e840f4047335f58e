"""The pronunciation dictionary store (gateway.text.store) and PLS files (gateway.text.pls)
without a gateway: limits across concurrent writers, versions, damaged files, and what the
parser refuses."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gateway.text.lexicon import AliasRule, PhonemeRule, RuleError, check_rules
from gateway.text.pls import PlsError, parse_pls, write_pls
from gateway.text.store import DictionaryStore, NoSuchDictionary, TooManyDictionaries

RULE = AliasRule(string_to_replace="nginx", alias="engine x")


def test_the_count_limit_holds_across_concurrent_creates(tmp_path: Path) -> None:
    results: list[str] = []
    lock = threading.Lock()

    def create() -> None:
        store = DictionaryStore(tmp_path)  # each its own descriptor of the lock file
        try:
            store.create(name="d", description=None, owner=None, rules=[RULE], max_dictionaries=5)
            out = "ok"
        except TooManyDictionaries:
            out = "full"
        with lock:
            results.append(out)

    threads = [threading.Thread(target=create) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("ok") == 5 and results.count("full") == 7
    assert len(DictionaryStore(tmp_path).ids()) == 5


def test_versions_are_kept_up_to_the_limit_and_damaged_files_are_skipped(tmp_path: Path) -> None:
    store = DictionaryStore(tmp_path)
    d = store.create(name="d", description="x", owner="o", rules=[RULE], max_dictionaries=10)
    for i in range(5):
        d = store.new_version(
            d.id, lambda rules, i=i: [*rules, AliasRule(string_to_replace=f"w{i}", alias="a")], 3
        )
    assert len(d.versions) == 3 and len(d.latest.rules) == 6
    assert store.get(d.id) == d
    with pytest.raises(NoSuchDictionary):
        store.new_version("NoSuchIdAtAll1", lambda r: r, 3)
    (store.directory / "BrokenBrokenBroken1.json").write_text("{not json")
    assert [r.id for r in store.list()] == [d.id]
    assert store.delete(d.id) and not store.delete(d.id)
    assert [p.name for p in store.directory.iterdir() if not p.name.startswith(".")] == [
        "BrokenBrokenBroken1.json"
    ]


def test_pls_round_trip_and_refusals() -> None:
    rules = [RULE, AliasRule(string_to_replace="R&D <dept>", alias="are and dee")]
    assert parse_pls(write_pls(rules), max_bytes=10_000, max_rules=10) == rules
    with pytest.raises(PlsError, match="limit is 10"):
        parse_pls(write_pls(rules), max_bytes=10, max_rules=10)
    with pytest.raises(PlsError, match="more than 1 rules"):
        parse_pls(write_pls(rules), max_bytes=10_000, max_rules=1)
    external = (
        b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
        b"<lexicon><lexeme><grapheme>a</grapheme><alias>&x;</alias></lexeme></lexicon>"
    )
    with pytest.raises(PlsError, match="DTD"):
        parse_pls(external, max_bytes=10_000, max_rules=10)
    with pytest.raises(PlsError, match="well-formed"):
        parse_pls(b"<lexicon><lexeme>", max_bytes=10_000, max_rules=10)


def test_phoneme_rules_are_refused_naming_the_rule() -> None:
    with pytest.raises(RuleError, match=r"'tomato'.*phoneme"):
        check_rules([RULE, PhonemeRule(string_to_replace="tomato", phoneme="x")], 10)
    with pytest.raises(RuleError, match="at most 1"):
        check_rules([RULE, RULE], 1)
