"""Custom voices in the llm_worker: zero-shot voices from the state directory.

A request names a custom voice by its id; the worker reads ``<state_dir>/voices/<id>.voice``
(written by a gateway, :mod:`store.voices`) and builds the voice's prompt prefix once. The
prefix is cached by the file's (inode, mtime), checked with one ``stat`` per request: a
voice deleted, or deleted and made again under the same id, is seen at once by every
worker (a restarted one included). A stream keeps the prefix it started with: deleting a
voice fails no stream already speaking with it.
"""

from __future__ import annotations

import logging

import msgspec

from common.voice_lookup import zero_shot_unsupported
from llm_worker.prompt import PromptBuilder
from llm_worker.requests import BadRequest
from store.voices import VoiceStore

log = logging.getLogger(__name__)

MAX_CACHED = 256


class ZeroShotVoices:
    def __init__(self, store: VoiceStore, prompts: PromptBuilder, supported: bool) -> None:
        self._store = store
        self._prompts = prompts
        self._supported = supported
        self._cache: dict[str, tuple[tuple[int, int], tuple[int, ...]]] = {}

    def has(self, vid: str) -> bool:
        """Whether there is a custom voice ``vid`` (one ``stat``; for ``VoiceLookup``)."""
        return self._store.stat_key(vid) is not None

    def prefix(self, vid: str) -> tuple[int, ...] | None:
        """The prompt prefix of custom voice ``vid``; None if there is no such voice.
        BadRequest if the model does not take zero-shot voices or the file is damaged."""
        key = self._store.stat_key(vid)
        if key is None:
            self._cache.pop(vid, None)
            return None
        if not self._supported:
            raise BadRequest(zero_shot_unsupported(vid))
        hit = self._cache.get(vid)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            record = self._store.get(vid)
        except (msgspec.DecodeError, OSError) as e:
            log.warning("custom voice %r unreadable: %s", vid, e)
            raise BadRequest(f"custom voice {vid!r} cannot be read: {e}") from None
        if record is None:
            return None
        ids = tuple(self._prompts.build_reference(record.transcript, record.code_frames()))
        if len(self._cache) >= MAX_CACHED:
            self._cache.pop(next(iter(self._cache)))
        self._cache[vid] = (key, ids)
        return ids
