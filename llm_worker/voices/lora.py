"""LoRA voices: many fine-tuned voices served by one engine through vLLM's multi-LoRA.

Voices come from ``[llm] lora_voices`` (name -> adapter) and from the admin API, which loads
and unloads adapters at run time (``POST /v1/admin/lora``, ``DELETE /v1/admin/lora/{name}``,
forwarded by a gateway over ROUTER ``layout.engine_admin(e)``). Run-time voices are written to the
state directory (:class:`store.lora.LoraRegistry`): a restarted worker loads them again and
every gateway lists them. Workers sharing the state directory (several pods on one volume)
follow each other's loads and unloads: ``LoraVoices.sync``, every ``llm.lora_sync_s``.

A request for a LoRA voice carries its adapter (``LoRARequest``); vLLM batches requests of
different adapters (at most ``max_loras`` in one step) with requests of the base model, whose
voices are unaffected. The prompt is the built-in one, ``"{speaker}: {text}"``, with the
name the fine-tune was trained with.

With the audio output head (:mod:`llm_worker.engine.output_head`) the vocabulary rows are rotated
and the head is a slice of them: an adapter that touches ``lm_head`` or ``embed_tokens``
(as a LoRA target or in ``modules_to_save``) would be applied to the wrong rows, so it is
refused at load with a line that says so (serve it with ``llm.output_head = full``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from itertools import count

from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM

from common.config.llm import LLMConfig
from llm_worker.model_info import find_model_file
from shm.messages import AdminReply, AdminRequest, LoraLoad, LoraSync, LoraUnload
from store.lora import LoraEntry, LoraRegistry, LoraScan, LoraSignature
from store.voices import VoiceStore, voice_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedLora:
    name: str
    request: LoRARequest
    speaker: str
    runtime: bool
    """Loaded through the admin API (and kept in the state directory)."""

    def holds(self, entry: LoraEntry) -> bool:
        """Whether this is what ``entry`` describes (same adapter path and speaker)."""
        return self.request.lora_path == entry.path and self.speaker == _speaker(
            self.name, entry.speaker
        )


def _speaker(name: str, speaker: str | None) -> str:
    return (speaker or name).strip().lower()


class LoraVoices:
    def __init__(
        self,
        config: LLMConfig,
        registry: LoraRegistry,
        builtin: tuple[str, ...],
        custom: VoiceStore | None = None,
        *,
        audio_head: bool = False,
    ) -> None:
        self._config = config
        self._audio_head = audio_head
        self._registry = registry
        self._builtin = frozenset(builtin)
        self._custom = custom
        self._ids = count(1)
        self._voices: dict[str, LoadedLora] = {}
        for name, v in config.lora_voices.items():
            self._add(voice_id(name), v.path, v.speaker, runtime=False)
        self._lock = asyncio.Lock()
        """Held by ``handle`` and ``sync`` (and ``restore``): one change at a time."""
        self._seen: dict[str, LoraScan] = {}
        """The registry as the last scan found it (entries whose signature did not change
        are not read again)."""
        self._failed: dict[str, LoraSignature | None] = {}
        """Entries that failed to load here, with the signature of the entry that failed:
        not tried again until the entry is written again (an admin load rewrites it)."""

    @property
    def enabled(self) -> bool:
        return self._config.lora_enabled

    def _new(self, name: str, path: str, speaker: str | None, runtime: bool) -> LoadedLora:
        req = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)
        return LoadedLora(name, req, _speaker(name, speaker), runtime)

    def _add(self, name: str, path: str, speaker: str | None, runtime: bool) -> LoadedLora:
        lv = self._voices[name] = self._new(name, path, speaker, runtime)
        return lv

    def get(self, name: str) -> LoadedLora | None:
        return self._voices.get(name)

    def names(self) -> list[str]:
        return sorted(self._voices)

    async def restore(self, engine: AsyncLLM) -> None:
        """At start: load the configured adapters, then those loaded at run time before
        (``sync``).

        A run-time entry that fails to load (its adapter gone or bad) does not keep the
        worker down: the voice is left out of this worker's table and the failure is marked
        in the registry (``LoraRegistry.mark_failed``), so that gateways refuse the voice
        before admission and list why. An entry that loads clears a marker left by an
        earlier start; so does loading the voice again through the admin API."""
        async with self._lock:
            for lv in list(self._voices.values()):
                await self._add_to_engine(engine, lv)
            if self.enabled:
                await self._sync(engine)

    async def sync(self, engine: AsyncLLM) -> None:
        """Follow the registry, which workers sharing the state directory write: load the
        entries this worker does not hold (another worker's admin loads), unload the run-time
        voices whose entry is gone (another worker's unloads; the configured voices stay),
        and load again a voice whose entry now names another adapter or speaker.

        An entry that fails to load is marked (``mark_failed``) and not tried again until it
        is written again (an admin load rewrites it); one that loads clears its marker. A bad
        entry is logged, never raised: the llm_worker runs this periodically."""
        if not self.enabled:
            return
        async with self._lock:
            await self._sync(engine)

    async def _sync(self, engine: AsyncLLM) -> None:
        try:
            seen = self._registry.scan(self._seen)
        except OSError as exc:
            log.warning("LoRA voices: %s could not be listed: %s", self._registry.directory, exc)
            return
        self._seen = seen
        for name, lv in list(self._voices.items()):
            if lv.runtime and name not in seen:
                del self._voices[name]
                await self._remove(engine, lv)
                log.info("LoRA voice %r unloaded (its entry was removed)", name)
        for name in [n for n in self._failed if n not in seen]:
            del self._failed[name]
        for name, found in sorted(seen.items()):
            if found.entry is None:
                continue  # unreadable now: whatever is loaded stays as it is
            held = self._voices.get(name)
            if held is not None:
                if not held.runtime or held.holds(found.entry):
                    continue
            elif name in self._failed and self._failed[name] == found.signature:
                continue
            try:
                await self._load_entry(engine, name, found, held)
            except Exception:  # a bad entry must not end the worker
                log.exception("LoRA voice %r: loading its entry failed", name)

    async def _load_entry(
        self, engine: AsyncLLM, name: str, found: LoraScan, held: LoadedLora | None
    ) -> None:
        """Load the registry's entry ``name``; ``held``: the adapter it replaces."""
        assert found.entry is not None
        e = found.entry
        lv = self._new(name, e.path, e.speaker, runtime=True)
        try:
            await self._add_to_engine(engine, lv)
        except Exception as exc:  # a bad entry must not keep the worker down
            reason = f"{type(exc).__name__}: {exc}"
            log.error("LoRA voice %r (%s) not loaded: %s", name, e.path, reason)
            self._failed[name] = found.signature
            if held is not None:
                del self._voices[name]
                await self._remove(engine, held)
            self._mark(name, reason)
            return
        self._voices[name] = lv
        self._failed.pop(name, None)
        if held is not None:
            await self._remove(engine, held)
        try:
            self._registry.clear_failure(name)
        except OSError as exc:
            log.error("LoRA voice %r: its failure marker could not be removed: %s", name, exc)
        log.info("LoRA voice %r loaded from %s (state directory)", name, e.path)

    async def _remove(self, engine: AsyncLLM, lv: LoadedLora) -> None:
        """Take ``lv``'s adapter out of the engine (it is out of the table already). A stream
        already speaking with it keeps its LoRARequest: vLLM's worker loads the adapter
        again for a scheduled request that names one it does not hold."""
        try:
            await engine.remove_lora(lv.request.lora_int_id)
        except Exception as e:
            log.warning("LoRA voice %r: remove_lora failed: %s", lv.name, e)

    def _elsewhere(self, name: str) -> bool:
        """Whether another worker sharing the state directory holds the voice ``name``:
        its entry is there, this worker has not synced it yet, and it is not marked failed
        (a failed voice may be loaded again, from another path)."""
        return (
            name not in self._failed
            and self._registry.has(name)
            and self._registry.failure(name) is None
        )

    def _mark(self, name: str, reason: str) -> None:
        try:
            self._registry.mark_failed(name, reason)
        except OSError as exc:
            log.error("LoRA voice %r: the failure could not be recorded: %s", name, exc)

    async def handle(self, engine: AsyncLLM, req: AdminRequest) -> AdminReply:
        if not self.enabled:
            return AdminReply(
                req.request_id,
                400,
                "lora_disabled",
                "multi-LoRA is off: set [llm] enable_lora = true (or lora_voices) and restart",
            )
        if isinstance(req, LoraSync):
            await self.sync(engine)
            return AdminReply(req.request_id, 200)
        async with self._lock:
            if isinstance(req, LoraLoad):
                return await self._load(engine, req)
            if isinstance(req, LoraUnload):
                return await self._unload(engine, req)
        return AdminReply(0, 400, "bad_request", "unknown admin request")

    async def _load(self, engine: AsyncLLM, req: LoraLoad) -> AdminReply:
        try:
            name = voice_id(req.name)
        except ValueError as e:
            return AdminReply(req.request_id, 400, "invalid_name", str(e))
        taken = (
            name in self._voices
            or name in self._builtin
            or (self._custom is not None and self._custom.stat_key(name) is not None)
        )
        if taken or self._elsewhere(name):
            return AdminReply(req.request_id, 409, "voice_exists", f"voice {name!r} exists")
        if not req.path.strip():
            return AdminReply(req.request_id, 400, "invalid_path", "path is empty")
        lv = self._add(name, req.path, req.speaker, runtime=True)
        try:
            await self._add_to_engine(engine, lv)
        except Exception as e:
            del self._voices[name]
            log.warning("LoRA voice %r from %s not loaded: %s", name, req.path, e)
            return AdminReply(req.request_id, 400, "lora_load_failed", f"{type(e).__name__}: {e}")
        try:
            self._registry.save(
                LoraEntry(name=name, path=req.path, speaker=req.speaker, language=req.language)
            )
        except OSError as e:
            # Without its entry the next sync would unload it anyway.
            del self._voices[name]
            await self._remove(engine, lv)
            log.error("LoRA voice %r: its entry could not be written: %s", name, e)
            return AdminReply(
                req.request_id, 500, "internal_error", f"the entry could not be written: {e}"
            )
        self._failed.pop(name, None)
        log.info("LoRA voice %r loaded from %s", name, req.path)
        return AdminReply(req.request_id, 200, "", name)

    async def _unload(self, engine: AsyncLLM, req: LoraUnload) -> AdminReply:
        name = req.name.strip().lower()
        lv = self._voices.get(name)
        if lv is None:
            # Not loaded here: it failed to load here, or another worker sharing the state
            # directory loaded it and this one has not synced yet. Its entry goes; every
            # worker that holds the adapter drops it at its next sync.
            if self._registry.delete(name):
                self._failed.pop(name, None)
                log.info("LoRA voice %r (not loaded by this worker) removed", name)
                return AdminReply(req.request_id, 200, "", name)
            return AdminReply(req.request_id, 404, "not_found", f"no LoRA voice {name!r}")
        if not lv.runtime:
            return AdminReply(
                req.request_id,
                400,
                "configured_voice",
                f"{name!r} is configured in [llm] lora_voices: remove it there",
            )
        del self._voices[name]
        self._registry.delete(name)
        await self._remove(engine, lv)
        log.info("LoRA voice %r unloaded", name)
        return AdminReply(req.request_id, 200, "", name)

    async def _add_to_engine(self, engine: AsyncLLM, lv: LoadedLora) -> None:
        """Load ``lv``'s adapter; ValueError when the engine answers False (it refused it) or
        when the adapter touches the vocabulary rows the audio head rotates."""
        if self._audio_head and (touched := vocabulary_modules(lv.request.lora_path)):
            raise ValueError(
                f"the adapter changes {', '.join(touched)}, which the audio output head "
                "serves rotated and sliced: serve it with llm.output_head = full"
            )
        if not await engine.add_lora(lv.request):
            raise ValueError("the engine refused the adapter")


VOCABULARY_MODULES = ("lm_head", "embed_tokens")


def vocabulary_modules(path: str) -> list[str]:
    """The vocabulary modules (LM head, embedding) a PEFT adapter targets or saves whole,
    from its ``adapter_config.json`` (empty when it touches none or has no readable config:
    vLLM then judges the adapter itself)."""
    found = find_model_file(path, "adapter_config.json")
    if found is None:
        return []
    try:
        cfg = json.loads(found.read_text())
    except (OSError, ValueError):
        return []
    named: list[str] = []
    for key in ("target_modules", "modules_to_save"):
        value = cfg.get(key) or []
        named += [value] if isinstance(value, str) else [str(v) for v in value]
    return [m for m in VOCABULARY_MODULES if any(m in n for n in named)]
