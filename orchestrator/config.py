"""The whole server's configuration: one TOML file, then environment, then flags.

Each process's section is defined next to the process (``llm_worker/config.py`` ...);
this module composes them. It must stay import-light: every worker imports it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from codec_worker.config import CodecConfig
from gateway.config import GatewayConfig
from llm_worker.config import LLMConfig
from shm.config import ShmConfig
from shm.voices import VoicesConfig


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device: Literal["cpu", "cuda"] = "cuda"
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"
    llm: LLMConfig = LLMConfig()
    codec: CodecConfig = CodecConfig()
    gateway: GatewayConfig = GatewayConfig()
    shm: ShmConfig = ShmConfig()
    voices: VoicesConfig = VoicesConfig()
    drain_timeout_s: float = 30.0
    ready_timeout_s: float = 900.0
    """How long the workers may take to become warm before the orchestrator gives up."""
    heartbeat_timeout_s: float = 30.0
    """A ready worker silent this long is deemed hung: killed and restarted."""
