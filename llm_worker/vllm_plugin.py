"""orpheus-serve's vLLM plugin: registers the audio-head model class with vLLM's registry.

Declared in pyproject.toml under the ``vllm.general_plugins`` entry point group, which vLLM
loads in every process it starts (the engine core and its workers included), so the class is
known wherever the engine is built. ``VLLM_PLUGINS``, when an operator sets it, must name
``orpheus_serve`` for the audio head to load. Registration is lazy (a ``module:class``
string): nothing of the model is imported until vLLM builds it.
"""

from __future__ import annotations

from llm_worker.output_head import AUDIO_HEAD_ARCHITECTURE

MODEL_CLASS = "llm_worker.audio_head_model:OrpheusAudioHeadForCausalLM"


def register() -> None:
    """vLLM's plugin hook: make ``OrpheusAudioHeadForCausalLM`` a known architecture."""
    from vllm import ModelRegistry

    if AUDIO_HEAD_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(AUDIO_HEAD_ARCHITECTURE, MODEL_CLASS)
