"""The whole server's configuration: one TOML file, then environment, then flags.

Each process's section has its own module here (``llm_config.py``, ``codec_config.py``,
``gateway_config.py``; the transport's ``shm.config`` and ``shm.voices``); this module
composes them. It must stay import-light: every process imports it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common.codec_config import CodecConfig
from common.gateway_config import GatewayConfig
from common.llm_config import LLMConfig
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
