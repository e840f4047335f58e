"""W3C Pronunciation Lexicon Specification (PLS 1.0) files: read into rules, written from them.

Reading is ``defusedxml``'s parser with document type declarations refused outright
(``forbid_dtd``): no entity of any kind can be declared, so entity expansion (the
"billion laughs"), external entities and DTD fetches cannot happen. The file is bounded
before it is parsed (``max_bytes``) and its lexemes after (``max_rules``). Each
``<grapheme>`` of a ``<lexeme>`` with an ``<alias>`` becomes an alias rule; a lexeme with
only a ``<phoneme>`` is refused as the rules API refuses phoneme rules
(``gateway.text.lexicon``). The lexicon's ``xml:lang`` is the dictionary's language: it
applies only to requests in that language (``gateway.text.service``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from xml.sax.saxutils import escape

import msgspec
from defusedxml import DefusedXmlException
from defusedxml.ElementTree import fromstring

from common.languages import UnknownLanguage, language_tag
from gateway.text.lexicon import AliasRule, RuleError, check_rules, phoneme_refusal

PLS_NS = "http://www.w3.org/2005/01/pronunciation-lexicon"
_XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"


class PlsDocument(msgspec.Struct, frozen=True):
    rules: list[AliasRule]
    language: str | None
    """Its ``xml:lang`` as an ISO 639-1 code; None where it has none."""


class PlsError(ValueError):
    """Not a PLS file this server takes; the message says why."""


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _text(el: ET.Element) -> str:
    return " ".join("".join(el.itertext()).split())


def parse_pls(data: bytes, *, max_bytes: int, max_rules: int) -> list[AliasRule]:
    """The alias rules of a PLS document; PlsError for anything else."""
    return read_pls(data, max_bytes=max_bytes, max_rules=max_rules).rules


def read_pls(data: bytes, *, max_bytes: int, max_rules: int) -> PlsDocument:
    """The alias rules and the language of a PLS document; PlsError for anything else
    (an ``xml:lang`` that names no language included)."""
    if len(data) > max_bytes:
        raise PlsError(f"the file has {len(data)} bytes; the limit is {max_bytes}")
    if not data.strip():
        raise PlsError("the file is empty")
    try:
        root = fromstring(data, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except DefusedXmlException as e:
        raise PlsError(
            f"refused: {type(e).__name__} (DTDs and entities are not accepted)"
        ) from None
    except ET.ParseError as e:
        raise PlsError(f"not well-formed XML: {e}") from None
    if _local(root.tag) != "lexicon":
        raise PlsError(f"the root element is <{_local(root.tag)}>, not a PLS <lexicon>")
    alphabet = root.get("alphabet", "ipa")
    language: str | None = None
    if root.get(_XML_LANG):
        try:
            language = language_tag(root.get(_XML_LANG, ""))
        except UnknownLanguage as e:
            raise PlsError(f"xml:lang: {e}") from None
    rules: list[AliasRule] = []
    for lexeme in root:
        if _local(lexeme.tag) != "lexeme":
            continue
        graphemes = [_text(g) for g in lexeme if _local(g.tag) == "grapheme"]
        aliases = [_text(a) for a in lexeme if _local(a.tag) == "alias"]
        phonemes = [_text(p) for p in lexeme if _local(p.tag) == "phoneme"]
        graphemes = [g for g in graphemes if g]
        if not graphemes:
            raise PlsError("a <lexeme> has no <grapheme>")
        if not aliases:
            if phonemes:
                raise PlsError(phoneme_refusal(graphemes[0], phonemes[0], alphabet))
            raise PlsError(f"the <lexeme> of {graphemes[0]!r} has no <alias>")
        for g in graphemes:
            rules.append(AliasRule(string_to_replace=g, alias=aliases[0]))
            if len(rules) > max_rules:
                raise PlsError(f"more than {max_rules} rules; a dictionary holds at most that")
    try:
        return PlsDocument(check_rules(list(rules), max_rules), language)
    except RuleError as e:
        raise PlsError(str(e)) from None


def write_pls(rules: list[AliasRule], lang: str = "en-US") -> bytes:
    """``rules`` as a PLS 1.0 document (UTF-8)."""
    lines = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<lexicon version="1.0" xmlns="{PLS_NS}" alphabet="ipa" xml:lang="{escape(lang)}">',
    ]
    for r in rules:
        lines.append(
            f"  <lexeme><grapheme>{escape(r.string_to_replace)}</grapheme>"
            f"<alias>{escape(r.alias)}</alias></lexeme>"
        )
    lines.append("</lexicon>")
    return ("\n".join(lines) + "\n").encode()
