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
    queue_timeout_s: float = 10.0
    """A request that waited this long in the admission queue is answered 429."""
    api_keys: list[str] = []
    max_input_chars: int = 4096
    max_body_bytes: int = 64 * 1024
    max_buffered_seconds: float = 30.0
    """Audio a slow client may leave unread before its stream is dropped."""
    client_stall_timeout_s: float = 15.0
    """A client that accepts no bytes for this long while audio waits for it is dropped."""
    upstream_idle_timeout_s: float = 30.0
    """A stream whose text is complete and that receives nothing for this long fails (504)."""
    ws_start_timeout_s: float = 10.0
    """A WebSocket client must send its first message (vLLM-Omni ``session.config``, Baseten's
    start message) within this time."""
    ws_text_idle_timeout_s: float = 120.0
    """A vLLM-Omni or Baseten WebSocket is closed when nothing is being spoken and no message
    arrives for this long (ElevenLabs sockets: their ``inactivity_timeout``)."""
    voice_aliases: dict[str, str] = msgspec.field(default_factory=lambda: dict(OPENAI_VOICES))
    served_model_names: list[str] = msgspec.field(
        default_factory=lambda: ["tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    )
    """Names listed by ``GET /v1/models`` besides the model itself (any name is accepted)."""
    zmq_endpoint: str | None = None
    """ROUTER endpoint for internal ZeroMQ clients, e.g. "tcp://127.0.0.1:8001".

    With several gateway processes, process ``i`` binds ``port + i`` (tcp) or ``path-i`` (ipc).
    """
    zmq_max_message_bytes: int = 64 * 1024
    """Largest ZeroMQ frame the ROUTER accepts (``ZMQ_MAXMSGSIZE``): a client that sends a
    larger one is disconnected before the frame is read, and its requests end unanswered.
    The default is the HTTP body limit; ZeroMQ carries no voice upload (HTTP only)."""
    zmq_text_idle_timeout_s: float = 120.0
    """A ZeroMQ request with ``text_open`` whose text is not finished fails (408 ``timeout``)
    when no ``append`` arrives and nothing is spoken for this long (it frees its stream slot)."""
    http_error_log_interval_s: float = 60.0
    """A client's malformed HTTP requests (answered 400 by aiohttp) are logged at most once per
    this interval per client address, at WARNING, without the request's bytes."""
    retry_after_s: int = 1
    playground: bool = True
    """Serve the playground page at ``/``."""
    access_log: bool = False
