"""LoRA voices: many fine-tuned voices served by one engine through vLLM's multi-LoRA.

Voices come from ``[llm] lora_voices`` (name -> adapter) and from the admin API, which loads
and unloads adapters at run time (``POST /v1/admin/lora``, ``DELETE /v1/admin/lora/{name}``,
forwarded by a gateway over ROUTER ``layout.admin``). Run-time voices are written to the
state directory (:class:`shm.voices.LoraRegistry`): a restarted worker loads them again and
every gateway lists them.

A request for a LoRA voice carries its adapter (``LoRARequest``); vLLM batches requests of
different adapters (at most ``max_loras`` in one step) with requests of the base model, whose
voices are unaffected. The prompt is the built-in one, ``"{speaker}: {text}"``, with the
name the fine-tune was trained with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import count

from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM

from common.llm_config import LLMConfig
from shm.messages import AdminReply, AdminRequest, LoraLoad, LoraUnload
from shm.voices import LoraEntry, LoraRegistry, VoiceStore, voice_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedLora:
    name: str
    request: LoRARequest
    speaker: str
    runtime: bool
    """Loaded through the admin API (and kept in the state directory)."""


class LoraVoices:
    def __init__(
        self,
        config: LLMConfig,
        registry: LoraRegistry,
        builtin: tuple[str, ...],
        custom: VoiceStore | None = None,
    ) -> None:
        self._config = config
        self._registry = registry
        self._builtin = frozenset(builtin)
        self._custom = custom
        self._ids = count(1)
        self._voices: dict[str, LoadedLora] = {}
        for name, v in config.lora_voices.items():
            self._add(voice_id(name), v.path, v.speaker, runtime=False)

    @property
    def enabled(self) -> bool:
        return self._config.lora_enabled

    def _add(self, name: str, path: str, speaker: str | None, runtime: bool) -> LoadedLora:
        req = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)
        lv = LoadedLora(name, req, (speaker or name).strip().lower(), runtime)
        self._voices[name] = lv
        return lv

    def get(self, name: str) -> LoadedLora | None:
        return self._voices.get(name)

    def names(self) -> list[str]:
        return sorted(self._voices)

    async def restore(self, engine: AsyncLLM) -> None:
        """At start: load the configured adapters, then those loaded at run time before.

        A run-time entry that fails to load (its adapter gone or bad) does not keep the
        worker down: the voice is left out of this worker's table and the failure is marked
        in the registry (``LoraRegistry.mark_failed``), so that gateways refuse the voice
        before admission and list why. An entry that loads clears a marker left by an
        earlier start; so does loading the voice again through the admin API."""
        for lv in list(self._voices.values()):
            await engine.add_lora(lv.request)
        if not self.enabled:
            return
        for e in self._registry.entries():
            if e.name in self._voices:
                continue
            lv = self._add(e.name, e.path, e.speaker, runtime=True)
            try:
                if not await engine.add_lora(lv.request):
                    raise ValueError("the engine refused the adapter")
            except Exception as exc:  # a bad entry must not keep the worker down
                del self._voices[e.name]
                reason = f"{type(exc).__name__}: {exc}"
                log.error("LoRA voice %r (%s) not restored: %s", e.name, e.path, reason)
                self._mark(e.name, reason)
            else:
                self._registry.clear_failure(e.name)

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
        if taken:
            return AdminReply(req.request_id, 409, "voice_exists", f"voice {name!r} exists")
        if not req.path.strip():
            return AdminReply(req.request_id, 400, "invalid_path", "path is empty")
        lv = self._add(name, req.path, req.speaker, runtime=True)
        try:
            ok = await engine.add_lora(lv.request)
            if not ok:
                raise ValueError("the engine refused the adapter")
        except Exception as e:
            del self._voices[name]
            log.warning("LoRA voice %r from %s not loaded: %s", name, req.path, e)
            return AdminReply(req.request_id, 400, "lora_load_failed", f"{type(e).__name__}: {e}")
        self._registry.save(LoraEntry(name=name, path=req.path, speaker=req.speaker))
        log.info("LoRA voice %r loaded from %s", name, req.path)
        return AdminReply(req.request_id, 200, "", name)

    async def _unload(self, engine: AsyncLLM, req: LoraUnload) -> AdminReply:
        name = req.name.strip().lower()
        lv = self._voices.get(name)
        if lv is None:
            if self._registry.failure(name) is not None and self._registry.delete(name):
                log.info("LoRA voice %r (not restored at start) removed", name)
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
        # A stream already speaking with it keeps its LoRARequest: vLLM's worker loads the
        # adapter again for a scheduled request that names one it does not hold.
        try:
            await engine.remove_lora(lv.request.lora_int_id)
        except Exception as e:
            log.warning("LoRA voice %r: remove_lora failed: %s", name, e)
        log.info("LoRA voice %r unloaded", name)
        return AdminReply(req.request_id, 200, "", name)
