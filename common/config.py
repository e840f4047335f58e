"""The whole server's configuration: one TOML file, then environment, then flags.

Each process's section has its own module here (``llm_config.py``, ``codec_config.py``,
``gateway_config.py``; the transport's ``shm.config``, the state directory's
``store.voices``); this module composes them. It must stay import-light: every process
imports it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common.codec_config import CodecConfig
from common.gateway_config import GatewayConfig
from common.jobs_config import JobsConfig
from common.llm_config import LLMConfig
from common.text_config import TextConfig
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
    busy processes (common/cpu_plan.py). Nothing is done on CUDA, with one core, or when
    ``VLLM_CPU_OMP_THREADS_BIND`` is set."""
