"""orpheus-serve's vLLM plugin: registers the audio-head model class with vLLM's registry;
has TorchInductor remember its checks of the CPU's vector ISAs per host
(:mod:`llm_worker.vllm_ext.vec_isa`); on the CPU build starts the thread that hands free heap memory back
(:mod:`llm_worker.vllm_ext.heap_trim`, when the llm worker set
``ORPHEUS_SERVE_VLLM_HEAP_TRIM_S``); and, only when ``ORPHEUS_PROFILE_PHASES`` or
``ORPHEUS_PROFILE_MEMORY`` names a directory, loads the per-phase host timers into vLLM's
engine core (:mod:`llm_worker.vllm_ext.phase_timers`) or the memory sampler into every vLLM
process (:mod:`common.memory_probe`), measurement tools (unset, nothing of them
is imported or wrapped).

Declared in pyproject.toml under the ``vllm.general_plugins`` entry point group, which vLLM
loads in every process it starts (the engine core and its workers included), so the class is
known wherever the engine is built. ``VLLM_PLUGINS``, when an operator sets it, must name
``orpheus_serve`` for the audio head to load. Registration is lazy (a ``module:class``
string): nothing of the model is imported until vLLM builds it.
"""

from __future__ import annotations

import gc
import multiprocessing
import os

from llm_worker.vllm_ext import heap_trim, vec_isa
from llm_worker.vllm_ext.token_space import AUDIO_HEAD_ARCHITECTURE

PHASE_TIMERS_ENV = "ORPHEUS_PROFILE_PHASES"
"""Mirrors :data:`llm_worker.vllm_ext.phase_timers.ENV` (not imported: nothing of it loads when off)."""

MEMORY_PROBE_ENV = "ORPHEUS_PROFILE_MEMORY"
"""Mirrors :data:`common.memory_probe.ENV`: a directory, where every vLLM process
appends its memory samples (a measurement tool; unset, nothing is imported)."""

MODEL_CLASS = "llm_worker.vllm_ext.audio_head_model:OrpheusAudioHeadForCausalLM"


def register() -> None:
    """vLLM's plugin hook: make ``OrpheusAudioHeadForCausalLM`` a known architecture; with
    ``ORPHEUS_PROFILE_PHASES`` set, time the engine core's phases; in a process vLLM started,
    freeze what its import made (:func:`freeze_import_heap`)."""
    freeze_import_heap()
    vec_isa.remember_isa_checks()
    from vllm import ModelRegistry

    if AUDIO_HEAD_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(AUDIO_HEAD_ARCHITECTURE, MODEL_CLASS)
    if os.environ.get(PHASE_TIMERS_ENV, "").strip():
        from llm_worker.vllm_ext.phase_timers import install_from_environment

        install_from_environment()
    heap_trim.start_from_environment()
    if os.environ.get(MEMORY_PROBE_ENV, "").strip():
        from common import memory_probe

        memory_probe.install_from_environment()


def freeze_import_heap() -> None:
    """In a process vLLM started (its engine core, its workers: multiprocessing children),
    move everything alive now out of the cyclic collector's reach, as vLLM itself does once
    the engine is built (``freeze_gc_heap``). vLLM loads its plugins right after its import,
    and its start-up then runs three full collections (two in its model loader, one before its
    own freeze), each walking the million objects torch and vLLM's modules made: about 0.45 s
    each on a 2-core CPU, then a few milliseconds. The llm worker and a test's process, which
    load the plugin too, are not multiprocessing children and keep their heap collectable."""
    if multiprocessing.parent_process() is not None:
        gc.freeze()
