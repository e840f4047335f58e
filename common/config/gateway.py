"""Configuration of the gateway processes (the ``[gateway]`` table of the TOML file)."""

from __future__ import annotations

from typing import Literal

import msgspec

OPENAI_VOICES = {
    "alloy": "tara", "ash": "leo", "ballad": "dan", "cedar": "zac", "coral": "leah",
    "echo": "dan", "fable": "jess", "marin": "mia", "nova": "leah", "onyx": "leo",
    "sage": "zoe", "shimmer": "mia", "verse": "zac",
}  # fmt: skip


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # -- Listening, and everything before a handler (gateway/edge/)
    host: str = "127.0.0.1"
    port: int = 8000
    processes: int = 1
    max_connections: int = 8192
    """Client connections per gateway process (HTTP and WebSocket, idle ones included),
    lowered to the open-file limit less 256; a connection past it is answered 503 and closed
    (a WARNING at most every 10 s)."""
    header_timeout_s: float = 10.0
    """A new connection that has not sent a whole request header this long after connecting
    is answered 408 and closed (slow or stalled clients; 0: no limit)."""
    keepalive_timeout_s: float = 75.0
    """An idle kept-alive connection is closed after this long; it also bounds the header of
    each later request on the connection (longer than a load balancer's idle timeout, e.g.
    60 s, so that the balancer closes first)."""
    body_timeout_s: float = 60.0
    """A request's whole body must arrive this long after its header, else 408 and the
    connection is closed (0: no limit)."""
    max_body_bytes: int = 64 * 1024
    api_keys: list[str] = []
    admin_keys: list[str] = []
    """Keys for the admin calls (``/v1/admin/*``: loading and unloading LoRA adapters),
    separate from ``api_keys``, which do not open them. None: the admin calls are off (403
    ``admin_disabled``)."""
    metrics_require_key: bool = False
    """Put ``GET /metrics`` behind the API keys (``api_keys`` or ``admin_keys``; Prometheus
    sends one with its ``authorization`` setting). Off: it is open, like ``/health``."""
    allowed_origins: list[str] = []
    """Web origins (``https://app.example.com``) whose pages may call the server from a
    browser, besides the server's own (the playground); ``"*"``: any. A request or
    WebSocket upgrade with another ``Origin`` is refused (403 ``origin_not_allowed``);
    clients that send no ``Origin`` (SDKs, agents) are not affected."""
    allowed_hosts: list[str] = []
    """Host names the server answers to while no API key is configured, besides IP
    addresses, ``localhost`` and ``host``; ``"*"``: any. Another ``Host`` is refused (403
    ``host_not_allowed``; ``/health`` and ``/ready`` excepted): DNS rebinding."""
    http_error_log_interval_s: float = 60.0
    """A client's malformed HTTP requests (answered 400 by aiohttp) are logged at most once per
    this interval per client address, at WARNING, without the request's bytes."""
    access_log: bool = False
    playground: bool = True
    """Serve the playground page at ``/``."""

    # -- Admission (gateway/admission/)
    admission: Literal["learned", "fixed"] = "learned"
    """``learned``: each engine admits as many streams as it holds in real time, learned
    from the audio the gateway receives (``gateway/admission/capacity.py``); ``fixed``:
    ``max_active_streams`` is the operating point."""
    max_active_streams: int = 256
    max_queued_streams: int = 64
    queue_timeout_s: float = 10.0
    """A request that waited this long in the admission queue is answered 429 (learned
    admission waits less: what the TTFB budget leaves)."""
    ttfb_budget_s: float = 1.0
    """Learned admission: the time to first audio a client can use. A request that cannot
    start within it is refused at once (429 with Retry-After), and the limit keeps the
    streams' start time within half of it."""
    realtime_margin: float = 0.1
    """Learned admission: the speed above real time admitted streams must keep (0.1: audio
    arrives 1.1 times as fast as it plays)."""
    max_streams_per_key: int = 0
    """Streams one API key may hold at once (an HTTP request, a WebSocket utterance, a
    ZeroMQ request); one more is answered 429 ``too_many_concurrent_requests``. 0: no limit."""
    key_max_streams: dict[str, int] = {}
    """Per-key overrides of ``max_streams_per_key`` (the key as clients send it)."""
    key_weights: dict[str, float] = {}
    """Weights of API keys in the fair shares of a full node (the key as clients send it;
    others weigh 1): while several keys want more than the node holds, each gets its demand
    or its weight's part of the node's capacity, whichever is less, and a key over its share
    is refused 429 ``too_many_concurrent_requests`` (docs/api.md)."""
    retry_after_s: int = 1
    early_refusal: bool = False
    """A key just refused for the node (``server_busy``) or for its share or limit
    (``too_many_concurrent_requests``) hears the same 429 before its next HTTP speech
    request's body is read, while nothing that could admit it happened, for at most a second
    (``gateway.admission.queue``). Off by default: it saves about 0.1-0.3 ms of gateway CPU a
    refusal (docs/performance.md), and a malformed request of such a key would hear 429
    instead of its 400. Never with the sentence audio cache (a hit needs no slot)."""

    # -- A request's text (gateway/text/, the front ends)
    max_input_chars: int = 4096
    max_break_s: float = 3.0
    """The longest pause a ``<break time="..."/>`` tag may ask for (ElevenLabs': 3 s); a
    longer one is refused (400 ``break_too_long``; a socket's error message), never cut."""
    ws_max_queued_chars: int = 16384
    """Text one WebSocket connection may have waiting to be spoken (received, not yet
    started); a text message past it is refused with ``input_queue_full`` (Baseten: closed
    with 1013) and not taken."""
    ws_max_queued_sentences: int = 256
    """Sentences (units) one WebSocket connection may have waiting to be spoken, as above."""

    # -- Voices and model names (gateway/voices/)
    voice_aliases: dict[str, str] = msgspec.field(default_factory=lambda: dict(OPENAI_VOICES))
    served_model_names: list[str] = msgspec.field(
        default_factory=lambda: ["tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    )
    """Names listed by ``GET /v1/models`` besides the model itself (any name is accepted)."""
    lora_dirs: list[str] = []
    """Directories an adapter loaded through ``POST /v1/admin/lora`` must lie in (its path,
    symbolic links resolved); another path is 400 ``lora_path_not_allowed``. None: no
    adapter may be loaded at run time."""

    # -- A stream's life (gateway/streams.py, link.py, upstream.py)
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
    arrives for this long, an utterance open or not (ElevenLabs sockets: their
    ``inactivity_timeout``)."""

    # -- The ZeroMQ front end (gateway/frontends/zeromq/)
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


GATEWAY_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Listening, and everything before a handler (gateway/edge/)",
        (
            "host",
            "port",
            "processes",
            "max_connections",
            "header_timeout_s",
            "keepalive_timeout_s",
            "body_timeout_s",
            "max_body_bytes",
            "api_keys",
            "admin_keys",
            "metrics_require_key",
            "allowed_origins",
            "allowed_hosts",
            "http_error_log_interval_s",
            "access_log",
            "playground",
        ),
    ),
    (
        "Admission (gateway/admission/)",
        (
            "admission",
            "max_active_streams",
            "max_queued_streams",
            "queue_timeout_s",
            "ttfb_budget_s",
            "realtime_margin",
            "max_streams_per_key",
            "key_max_streams",
            "key_weights",
            "retry_after_s",
            "early_refusal",
        ),
    ),
    (
        "A request's text (gateway/text/, the front ends)",
        (
            "max_input_chars",
            "max_break_s",
            "ws_max_queued_chars",
            "ws_max_queued_sentences",
        ),
    ),
    (
        "Voices and model names (gateway/voices/)",
        (
            "voice_aliases",
            "served_model_names",
            "lora_dirs",
        ),
    ),
    (
        "A stream's life (gateway/streams.py, link.py, upstream.py)",
        (
            "max_buffered_seconds",
            "client_stall_timeout_s",
            "upstream_idle_timeout_s",
            "ws_start_timeout_s",
            "ws_text_idle_timeout_s",
        ),
    ),
    (
        "The ZeroMQ front end (gateway/frontends/zeromq/)",
        (
            "zmq_endpoint",
            "zmq_max_message_bytes",
            "zmq_text_idle_timeout_s",
        ),
    ),
)
"""``[gateway]``'s keys by the job they configure, in ``GatewayConfig``'s order (the
configuration reference, docs/configuration.md, shows a table per group)."""
