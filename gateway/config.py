"""Configuration of the gateway processes (the ``[gateway]`` table of the TOML file)."""

from __future__ import annotations

import msgspec

OPENAI_VOICES = {
    "alloy": "tara", "ash": "leo", "ballad": "dan", "cedar": "zac", "coral": "leah",
    "echo": "dan", "fable": "jess", "marin": "mia", "nova": "leah", "onyx": "leo",
    "sage": "zoe", "shimmer": "mia", "verse": "zac",
}  # fmt: skip


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    processes: int = 1
    max_active_streams: int = 256
    max_queued_streams: int = 64
    api_keys: list[str] = []
    max_input_chars: int = 4096
    max_body_bytes: int = 64 * 1024
    max_buffered_seconds: float = 30.0
    """Audio a slow client may leave unread before its stream is dropped."""
    voice_aliases: dict[str, str] = OPENAI_VOICES
    zmq_endpoint: str | None = None
    """ROUTER endpoint for internal ZeroMQ clients, e.g. "tcp://127.0.0.1:8001"."""
    retry_after_s: int = 1
