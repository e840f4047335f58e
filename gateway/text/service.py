"""The gateway's text service: a request's ``apply_text_normalization`` and
``pronunciation_dictionary_locators`` resolved into a ``TextPlan``, and the dictionary store
with its ownership rules (``gateway.text.store``).

Resolution reads a dictionary's file only when it changed (its stat key) or a version was
never compiled in this process: compiled versions are immutable and kept (LRU), so a request
naming known versions costs a ``stat`` per "latest" locator and no file read.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from common.config import ServeConfig
from common.languages import DEFAULT_LANGUAGE
from gateway.edge.auth import ApiKeys
from gateway.errors import APIError
from gateway.text.lexicon import Lexicon
from gateway.text.plan import TextPlan
from gateway.text.store import DictionaryRecord, DictionaryStore
from orpheus_wire.text import Locator

MAX_LOCATORS = 3
"""Dictionaries one request may name (ElevenLabs' limit)."""
COMPILED_CACHE = 256


class SpeechText:
    """One per gateway process (``Gateway.speech_text``)."""

    def __init__(self, config: ServeConfig) -> None:
        self.cfg = config.text
        self.store = DictionaryStore(config.voices.state_dir)
        self._keys_required = bool(config.gateway.api_keys)
        self._admin = ApiKeys(config.gateway.admin_keys)
        self._compiled: OrderedDict[tuple[str, str], Lexicon] = OrderedDict()
        self._latest: dict[str, tuple[tuple[int, int], DictionaryRecord]] = {}
        self._lock = threading.Lock()
        """Guards the two caches: resolution runs on the executor's threads."""
        self.defaults = [self._parse_default(d) for d in self.cfg.pronunciation_dictionaries]
        self._normalize_only: dict[str, TextPlan] = {}
        """Per language: the plan of a request with no dictionaries (built once)."""

    @staticmethod
    def _parse_default(entry: str) -> Locator:
        did, _, version = entry.strip().partition(":")
        return Locator(pronunciation_dictionary_id=did, version_id=version or None)

    # -- ownership ---------------------------------------------------------------------------
    def owner_of(self, key: str | None) -> str | None:
        """What a dictionary made with ``key`` records as its owner."""
        if not self._keys_required or not key:
            return None
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    def is_admin(self, key: str | None) -> bool:
        return self._admin.required and bool(key) and self._admin.allows(key)

    def visible(self, record: DictionaryRecord, key: str | None) -> bool:
        if not self._keys_required or self.is_admin(key):
            return True
        return record.owner == self.owner_of(key)

    # -- resolution --------------------------------------------------------------------------
    def _record(self, did: str) -> DictionaryRecord | None:
        """The dictionary's record, read again only when its file changed (blocking: run it
        off the event loop)."""
        key = self.store.stat_key(did)
        if key is None:
            self._latest.pop(did, None)
            return None
        cached = self._latest.get(did)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            record = self.store.get(did)
        except (msgspec.DecodeError, OSError):
            return None
        if record is not None:
            self._latest[did] = (key, record)
        return record

    def _lexicon(self, record: DictionaryRecord, version_id: str | None) -> Lexicon | None:
        version = record.version(version_id)
        if version is None:
            return None
        ck = (record.id, version.version_id)
        lx = self._compiled.get(ck)
        if lx is None:
            lx = self._compiled[ck] = Lexicon(version.rules)
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(ck)
        return lx

    def _resolve(
        self, locators: Sequence[Locator], key: str | None, language: str, *, owned: bool
    ) -> tuple[list[Lexicon], list[str]]:
        """The lexicons of ``locators`` for a request in ``language`` (a dictionary in
        another language, its PLS ``xml:lang``, is skipped) and the locators not found."""
        found: list[Lexicon] = []
        missing: list[str] = []
        for loc in locators:
            record = self._record(loc.pronunciation_dictionary_id)
            if record is None or (owned and not self.visible(record, key)):
                missing.append(loc.pronunciation_dictionary_id)
                continue
            if record.language is not None and record.language != language:
                continue
            lx = self._lexicon(record, loc.version_id)
            if lx is None:
                missing.append(f"{loc.pronunciation_dictionary_id} version {loc.version_id}")
            else:
                found.append(lx)
        return found, missing

    def _plan_sync(
        self, locators: Sequence[Locator], normalize: bool, key: str | None, language: str
    ) -> TextPlan | None:
        with self._lock:
            return self._plan_locked(locators, normalize, key, language)

    def _plan_locked(
        self, locators: Sequence[Locator], normalize: bool, key: str | None, language: str
    ) -> TextPlan | None:
        own, missing = self._resolve(locators, key, language, owned=True)
        if missing:
            raise APIError(
                404,
                "pronunciation_dictionary_not_found",
                "no pronunciation dictionary "
                + ", ".join(repr(m) for m in missing)
                + " (GET /v1/pronunciation-dictionaries lists yours)",
                param="pronunciation_dictionary_locators",
            )
        defaults, missing = self._resolve(self.defaults, key, language, owned=False)
        if missing:
            raise APIError(
                500,
                "pronunciation_dictionary_not_found",
                "the server's default pronunciation dictionary "
                + ", ".join(repr(m) for m in missing)
                + " does not exist (text.pronunciation_dictionaries)",
            )
        lexicons = tuple(own + defaults)
        if not lexicons and not normalize:
            return None
        return TextPlan(lexicons, normalize, language)

    def normalizes(self, mode: str | None) -> bool:
        """Whether ``apply_text_normalization`` = ``mode`` normalises; APIError 400 for a
        value that is not one of auto/on/off."""
        if mode is None or mode == "auto":
            return self.cfg.normalization == "on"
        if mode == "on":
            return True
        if mode == "off":
            return False
        raise APIError(
            400,
            "invalid_request",
            f"apply_text_normalization must be one of auto, on, off; got {mode!r}",
            param="apply_text_normalization",
        )

    async def plan(
        self,
        locators: Sequence[Locator] | None = None,
        normalization: str | None = None,
        key: str | None = None,
        language: str = DEFAULT_LANGUAGE,
    ) -> TextPlan | None:
        """The plan of a request in ``language`` (an ISO 639-1 code: the front end resolves
        it, ``gateway.voices.languages``); None: its text is spoken as sent. APIError 400 for
        a bad mode or too many locators, 404 naming the dictionaries this key has no access
        to."""
        normalize = self.normalizes(normalization)
        locators = list(locators or ())
        if len(locators) > MAX_LOCATORS:
            raise APIError(
                400,
                "invalid_request",
                f"{len(locators)} pronunciation dictionaries; at most {MAX_LOCATORS} per request",
                param="pronunciation_dictionary_locators",
            )
        if not locators and not self.defaults:
            if not normalize:
                return None
            plan = self._normalize_only.get(language)
            if plan is None:
                # A language's first plan builds its normaliser (cn2an's import: ~0.1 s):
                # off the event loop.
                plan = await asyncio.get_running_loop().run_in_executor(
                    None, TextPlan, (), True, language
                )
                self._normalize_only[language] = plan
            return plan
        return await asyncio.get_running_loop().run_in_executor(
            None, self._plan_sync, locators, normalize, key, language
        )
