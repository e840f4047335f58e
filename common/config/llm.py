"""Configuration of the llm_worker process (the ``[llm]`` table of the TOML file)."""

from __future__ import annotations

import msgspec


class VoiceSampling(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A voice's default sampling: the fields of ``orpheus_wire.sampling.SamplingFields``
    that are vLLM ``SamplingParams`` keywords (a request overrides each of them), with
    their values when the request leaves them out."""

    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.1
    top_k: int = 0


class LoraVoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    """The adapter: a local directory (PEFT layout: adapter_config.json and weights) or a
    Hugging Face name."""
    speaker: str | None = None
    """The name the fine-tune was trained with, for the prompt ``"{speaker}: {text}"``
    (None: the voice's own name)."""
    language: str | None = None
    """The language the voice speaks (ISO 639-1): a request for it that names none is
    normalised in it. None: the checkpoint's (``llm.languages``)."""


class LLMConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str = "canopylabs/orpheus-3b-0.1-ft"
    """HF name or local path of the Orpheus checkpoint (weights + tokenizer)."""
    tokenizer: str | None = None
    """Tokenizer name or path when it is not stored with the model."""
    max_model_len: int = 4096
    """Always set: the checkpoint declares 131k and vLLM would reserve KV cache for it."""
    engines: int = 1
    """vLLM engines (each its own llm worker process, engine core, control socket and code
    ring) sharing the device; 1..8. A stream is placed on one engine when it is admitted and
    stays there. The host work of one engine core caps the streams one engine can step in
    real time (docs/performance.md, "Several engines on one GPU"); on CUDA, run the engines
    under MPS (deploy/README.md, "CUDA MPS"). ``gpu_memory_utilization`` and
    ``kv_cache_memory_bytes`` are then split evenly between the engines, and each engine's
    ``max_num_seqs`` is its share of the streams."""
    max_num_seqs: int = 384
    gpu_memory_utilization: float = 0.85
    kv_cache_memory_bytes: int | None = None
    """Explicit KV cache size. None: from gpu_memory_utilization on CUDA; on CPU (where that
    fraction would be of host memory) what max_num_seqs full-length streams need, at most
    4 GiB."""
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    """"auto" or "fp8" (roughly doubles the streams the KV cache can hold)."""
    quantization: str | None = None
    """None or "fp8" (online FP8 weight quantization)."""
    cpu_onednn_cache: int = 64
    """CPU build: primitives oneDNN keeps in its cache in vLLM's engine core and worker
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; one set in the environment wins). vLLM's linear
    layers keep their last 32 shapes each; oneDNN's own cache otherwise grew with every new
    batch row count, about 100 KB a primitive and several MB per load peak
    (docs/performance.md, "Memory over hours")."""
    cpu_heap_trim_s: float = 15.0
    """CPU build: seconds between two hand-backs of free heap memory in vLLM's engine core
    and worker (``malloc_trim`` from a thread, only when more than 16 MiB is free; 0: never).
    Without it the worker kept each flood's freed activations resident and its RSS rose at
    every new high-water (docs/performance.md, "Memory over hours")."""
    async_scheduling: bool = True
    """Used wherever the installed vLLM supports it (never on the CPU build)."""
    enforce_eager: bool = False
    model_runner: str = "auto"
    """vLLM model runner: "v1" (legacy runner, orpheus tensor penalty and audio-token
    constraint), "v2" (GPU only: vLLM's device-resident penalty; the constraint only where the
    installed vLLM's V2 runner takes custom processors, 0.32+), or "auto": v2 where it can run
    (GPU build with Triton), else v1. H100, vLLM 0.25.1: v2 held 78 streams, v1 45
    (docs/performance.md)."""
    output_head: str = "auto"
    """Which logits the engine computes: "audio" (only the ids Orpheus can emit: the 28,684
    ids from ``<custom_token_0>`` on, i.e. the special tokens and the audio block, about 5.5x
    fewer columns for the LM head, penalties, temperature and top-p; text tokens can no longer
    be sampled), "full" (the whole 156,940-token vocabulary), or "auto": audio wherever it is
    supported (llm_worker/engine/output_head.py says where). Greedy outputs are identical either way
    (docs/performance.md, "The audio-only output head")."""
    tensor_penalties: bool = True
    """Repetition penalty kept in preallocated tensors (ours) instead of vLLM's list path."""
    constrain_audio_tokens: bool = True
    """Only the current slot's audio range (or end-of-speech at a frame boundary) is sampled."""
    voices: list[str] | None = None
    """Voices the model knows; None reads them from the model directory or uses the English set."""
    languages: list[str] | None = None
    """Languages the checkpoint speaks (ISO 639-1), its main one first: a request that names
    no language, for a voice with none of its own, is in the first. None: what the model
    directory declares (config.json ``orpheus.languages`` / ``orpheus.language``, else the
    ``language:`` of its model card, README.md), else ``text.language``."""
    voice_languages: dict[str, str] = {}
    """Voice -> the language it speaks, for a checkpoint with voices in several languages.
    Empty: what config.json ``orpheus.voices`` declares when it maps voices to languages."""
    default_voice: str = "tara"
    zero_shot: bool | None = None
    """Whether the model takes custom voices made from reference audio (zero-shot). None:
    what its config.json declares (``orpheus.zero_shot``); a checkpoint that does not declare
    it answers ``POST /v1/audio/voices`` and requests for such voices with 400."""
    sampling: VoiceSampling = VoiceSampling()
    voice_sampling: dict[str, VoiceSampling] = {}
    enable_prefix_caching: bool = True
    """vLLM's prefix cache: a custom voice's reference turn (hundreds to thousands of tokens)
    is computed once and reused by every request with the voice. Off only to measure it."""
    engine_stats: bool = True
    """vLLM's own statistics: the ``vllm:*`` Prometheus metrics (KV cache use, queue lengths,
    preemptions: the alerts in deploy/prometheus use them) and its periodic stats log line.
    False drops the engine core's and the output processor's per-request statistics work on
    every step and those metrics (docs/performance.md, "Leaner host work per step")."""
    lora_voices: dict[str, LoraVoice] = {}
    """LoRA voices: voice name -> adapter. A request for one runs with its adapter (vLLM
    multi-LoRA); the base model's voices are unaffected."""
    enable_lora: bool = False
    """Build the engine with multi-LoRA even with no ``lora_voices`` (for adapters loaded at
    run time through the admin API). On when ``lora_voices`` is not empty."""
    max_loras: int = 4
    """Most adapters in one engine batch (vLLM ``max_loras``)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted (vLLM ``max_lora_rank``: 1, 8, 16, 32, 64, 128, 256,
    320 or 512)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (vLLM ``max_cpu_loras``; None: ``max_loras``)."""
    lora_sync_s: float = 5.0
    """How often the llm worker follows the LoRA voices loaded and unloaded at run time
    through other workers sharing ``voices.state_dir`` (several pods on one volume): it
    loads the new entries and unloads the removed ones. 0: never (each worker keeps what
    it loaded itself and at start)."""
    max_tokens_per_char: float = 7.0
    """Cap on audio tokens per input character (about 7 frames of codes per second of speech)."""
    min_max_tokens: int = 350
    max_tokens_cap: int = 4096
    max_chars_per_segment: int = 280
    """Long text is split at sentence boundaries into pieces of at most this many characters."""
    repetition_guard_frames: int = 48
    """End a generation whose last N frames repeat a short cycle (runaway loop)."""
    seed: int = 0
    ring_full_timeout_s: float = 10.0
    """How long the worker waits for space in a full code ring before it fails the stream
    it is writing (ERROR "backpressure")."""

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_voices)
