"""The whole server's configuration: one TOML file, then environment, then flags.

One module per section in this package: ``llm``, ``codec``, ``gateway``, ``jobs``,
``text`` and ``cache``; the transport's section is ``shm.config`` and the state directory's
``store.voices.VoicesConfig``, because ``shm`` and ``store`` sit below ``common`` in the
import layers and read their own sections. This module composes them into
:class:`ServeConfig` and names the keys an operator has no reason to set
(:data:`INTERNAL_KEYS`). It must stay import-light: every process imports it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common.config.cache import CacheConfig
from common.config.codec import CodecConfig
from common.config.gateway import GatewayConfig
from common.config.jobs import JobsConfig
from common.config.llm import LLMConfig
from common.config.text import TextConfig
from shm.config import ShmConfig
from store.voices import VoicesConfig


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device: Literal["cpu", "cuda"] = "cuda"
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"
    llm: LLMConfig = LLMConfig()
    codec: CodecConfig = CodecConfig()
    gateway: GatewayConfig = GatewayConfig()
    shm: ShmConfig = ShmConfig()
    voices: VoicesConfig = VoicesConfig()
    jobs: JobsConfig = JobsConfig()
    text: TextConfig = TextConfig()
    cache: CacheConfig = CacheConfig()
    drain_timeout_s: float = 30.0
    ready_timeout_s: float = 900.0
    """How long the workers may take to become warm before the orchestrator gives up."""
    heartbeat_timeout_s: float = 30.0
    """A ready worker silent this long is deemed hung: killed and restarted."""
    otlp_traces_endpoint: str = ""
    """Where every process sends its OpenTelemetry traces (OTLP; with the default
    ``http/protobuf`` protocol the full URL, ``http://collector:4318/v1/traces``). Empty: the
    standard variables decide (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` turn tracing on; they win over this key);
    ``OTEL_SDK_DISABLED=true`` turns it off. docs/operations.md, "Tracing"."""
    cpu_affinity: Literal["auto", "off"] = "auto"
    """With ``device = "cpu"``: ``auto`` pins the llm worker and its vLLM processes to the
    first three quarters of the cores (``VLLM_CPU_OMP_THREADS_BIND`` for vLLM's threads) and
    the codec and the gateways to the rest, so that a codec window never waits behind vLLM's
    busy processes (common/cpu_plan.py). Where ``VLLM_CPU_OMP_THREADS_BIND`` names the cores
    (``1``, ``0-5``), those are vLLM's and the codec and the gateways get the rest. Nothing is
    done on CUDA, with one core, or with a binding that leaves no core to the others."""


INTERNAL_KEYS: dict[str, str] = {
    # [llm]: engine switches chosen by "auto", and constants of the model or measured once
    "llm.async_scheduling": "an A/B switch of `bench engine`; used wherever vLLM supports it",
    "llm.model_runner": "`auto` pins the runner the sampling plan needs; `bench engine` varies it",
    "llm.output_head": "`auto` picks the audio head where it applies; `bench engine` varies it",
    "llm.tensor_penalties": "an A/B switch of `bench penalties`",
    "llm.constrain_audio_tokens": "an A/B switch of the benches; off speaks invalid codes",
    "llm.enable_prefix_caching": "an A/B switch; off makes every custom voice's prompt cost again",
    "llm.engine_stats": "an A/B switch of `bench engine` (the `vllm:*` metrics go with it)",
    "llm.cpu_onednn_cache": "the CPU build's memory bound, measured (docs/performance.md)",
    "llm.cpu_heap_trim_s": "the CPU build's memory bound, measured (docs/performance.md)",
    "llm.max_cpu_loras": "vLLM's own default (`max_loras`) is what the LoRA voices need",
    "llm.lora_sync_s": "how often workers compare their adapters; no operator trade-off",
    "llm.max_tokens_per_char": "a property of the model: about 7 frames a second of speech",
    "llm.min_max_tokens": "a property of the model: the shortest text's audio budget",
    "llm.max_chars_per_segment": "a property of the model: the piece it speaks without looping "
    "(a long-form job's units are cut at it too)",
    "llm.repetition_guard_frames": "a property of the model: its runaway loops' shape",
    "llm.ring_full_timeout_s": "a code ring full this long means a stuck codec, not load",
    "llm.seed": "the tests' determinism; a request's own seed is the client's control",
    # [codec]: the decode windows' shape, chosen by measurement (`bench codec --sweep`)
    "codec.context_frames": "measured with `bench codec --sweep` (docs/performance.md)",
    "codec.hop_frames": "measured with `bench codec --sweep` (docs/performance.md)",
    "codec.lookahead_frames": "measured with `bench codec --sweep` (docs/performance.md)",
    "codec.first_hop_frames": "measured with `bench codec --sweep` (docs/performance.md)",
    "codec.max_hop_frames": "measured with `bench codec --sweep` (docs/performance.md)",
    "codec.max_wait_ms": "the batching window, measured with `bench codec`",
    "codec.hold_ahead_ms": "the scheduler's pacing, measured with `bench overload`",
    "codec.late_lookahead_ms": "the scheduler's late window, measured with `bench overload`",
    "codec.batch_buckets": "follows `codec.max_batch`; the compiled shapes",
    "codec.noise_seed": "the tests' determinism",
    "codec.compile_mode": "`codec.compile` is the operator's switch; the modes are `bench codec`'s A/B",
    "codec.threads": "the CPU profile sets it; nothing to choose on a GPU",
    "codec.pcm_stall_timeout_s": "a PCM ring full this long means a stuck gateway, not load",
    # [gateway]
    "gateway.realtime_margin": "learned admission's safety margin, measured with `bench overload`",
    "gateway.upstream_idle_timeout_s": "a worker silent this long is a fault the supervisor sees",
    "gateway.ws_max_queued_sentences": "`ws_max_queued_chars` is the bound clients meet first",
    "gateway.http_error_log_interval_s": "log rate limiting; no operator trade-off",
    "gateway.retry_after_s": "the clients' retry pace, measured with `bench overload`",
    "gateway.early_refusal": "an A/B switch of `bench overload`: it saved a few thousandths of a core",
    "gateway.zmq_max_message_bytes": "the HTTP body limit's twin; ZeroMQ carries text, no upload",
    "gateway.zmq_text_idle_timeout_s": "a fault timeout, `gateway.ws_text_idle_timeout_s`'s twin",
    # [shm]
    "shm.spin_us": "the rings' wake-up cost, measured with `bench ring`",
    "shm.recheck_ms": "the rings' lost-doorbell bound, measured with `bench ring`",
    # [voices]
    "voices.silence_dbfs": "what a silent clip is; no operator trade-off",
    "voices.encode_timeout_s": "a clip's encode this long means a stuck codec, not load",
    "voices.max_transcript_chars": "the transcript rides in every request's prompt, which "
    "`llm.max_model_len` bounds; `voices.max_seconds` is the clip's bound operators set",
    # [jobs]
    "jobs.streams_per_job": "`jobs.reserve_streams` and `max_running_jobs` bound jobs' share",
    "jobs.unit_retries": "retries of a worker fault; no operator trade-off",
    "jobs.join_fade_ms": "what joins units without a click; no operator trade-off",
    "jobs.poll_s": "how often gateways look for jobs; no operator trade-off",
    # [text]
    "text.max_dictionary_versions": "`text.max_dictionaries` is the bound operators set",
    "text.max_dictionary_rules": "`text.max_dictionaries` is the bound operators set; one "
    "version's rules are bounded by `text.max_pls_bytes` too",
    "text.max_pls_bytes": "one call's input bound; `text.max_dictionary_rules` bounds the rules",
    # [cache]: `cache.enabled` and `cache.scope` are the operator's two settings
    "cache.dir": "`voices.state_dir` places it, on the node's disk",
    "cache.max_bytes": "512 MiB hold ~3,700 sentences, far above a voice agent's stock "
    "phrases (bench/cache/policy.py: the hit ratio is flat past them)",
    "cache.ttl_s": "what changes a unit's audio is in its key; the TTL only ages entries out",
    "cache.admit_after": "the policy chosen by bench/cache/policy.py; an A/B switch",
    "cache.fleet_url": "a fleet's manifests set it beside the server they run (deploy/); "
    "none keeps each node's cache its own",
}
"""Keys an operator has no reason to set, each with why: they still load from the file, the
environment and ``--set`` (tests and benchmarks set them), and docs/configuration.md lists
them apart, as internal: they may change or go without notice."""

FOLDED_KEYS: dict[str, str] = {
    "jobs.unit_max_chars": "a job's units are cut at `llm.max_chars_per_segment`",
    "text.max_dialogue_chars": "a dialogue's turns together are bounded by "
    "`gateway.max_input_chars`, as one request's text",
}
"""Keys that were folded into another: a configuration that still sets one is refused with
what replaced it (``orchestrator.settings.load_config``), not with msgspec's unknown field."""
