"""Control messages that cross a process boundary over ZeroMQ (msgpack-encoded msgspec Structs).

Bulk data never travels here: code frames and PCM go through the shared-memory rings
(see ``shm.records``). Every message is a tagged Struct so one decoder handles a socket
that carries several kinds. The names say which boundary a message crosses; the public
ZeroMQ protocol's messages (``orpheus_wire.zeromq``: ``Speak``, ``AppendText``, ``Cancel``)
are a different, client-facing contract.

| messages | from -> to | socket (``shm.layout``) |
|---|---|---|
| ``LlmSubmit``, ``LlmAppendText``, ``LlmCancel`` (``LlmControl``) | gateway -> llm_worker | ``control-<engine>`` PUSH/PULL |
| ``LoraLoad``, ``LoraUnload``, ``LoraSync`` / ``AdminReply`` | gateway <-> llm_worker | ``admin-<engine>`` DEALER/ROUTER |
| ``EncodeRequest`` / ``EncodeReply`` | gateway <-> codec_worker | ``encode`` DEALER/ROUTER |
| ``DetectRequest`` / ``DetectReply`` | gateway <-> codec_worker | ``encode`` DEALER/ROUTER |
| ``WorkerReady``, ``Heartbeat``, ``WorkerFailed`` | worker -> orchestrator | ``orch`` PUSH/PULL |
| ``ClusterStatus`` | orchestrator -> gateways | ``status`` PUB/SUB |
"""

from __future__ import annotations

import msgspec

from orpheus_wire.sampling import SamplingFields


class SamplingOverrides(
    SamplingFields, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=False
):
    """Per-request overrides of the voice's sampling defaults (``orpheus_wire.sampling``'s
    fields, as a front end's request converts to them). ``None`` keeps the default."""


class LlmSubmit(msgspec.Struct, tag="submit", frozen=True, omit_defaults=True):
    """gateway -> llm_worker: start one utterance.

    ``stream_id`` is unique for the life of the instance; its high 16 bits name the
    gateway whose PCM ring receives the audio (see ``shm.records.gateway_of``).
    ``text`` may be appended to later with ``LlmAppendText`` when ``text_open`` is true
    (WebSocket clients that send text as their LLM writes it).
    ``traceparent`` is the request's W3C trace context when tracing is on (``common.tracing``):
    the llm worker's spans continue the gateway's trace; empty when off.
    """

    stream_id: int
    text: str
    voice: str
    sampling: SamplingOverrides = SamplingOverrides()
    text_open: bool = False
    traceparent: str = ""


class LlmAppendText(msgspec.Struct, tag="append", frozen=True):
    """gateway -> llm_worker: more text for an open stream; ``final`` closes its text."""

    stream_id: int
    text: str
    final: bool = False


class LlmCancel(msgspec.Struct, tag="cancel", frozen=True):
    """gateway -> llm_worker: the client went away; abort the vLLM request and drop state."""

    stream_id: int
    reason: str = "client_disconnected"


class WorkerReady(msgspec.Struct, tag="ready", frozen=True):
    """worker -> orchestrator: the worker is warm (engine loaded / codec compiled)."""

    role: str
    pid: int
    detail: str = ""


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """worker -> orchestrator, periodically: the worker's event loop is alive."""

    role: str
    pid: int
    active_streams: int = 0


class WorkerFailed(msgspec.Struct, tag="failed", frozen=True):
    """worker -> orchestrator: the worker failed in a way that retrying will not fix (model
    or codec not found, unreadable checkpoint, invalid configuration, port in use, ...).

    Before the worker was ever ready this stops the server (exit code
    ``orchestrator.failures.EXIT_PERMANENT``) with one line: ``cause`` and ``fix``.
    """

    role: str
    pid: int
    cause: str
    fix: str


class EngineStatus(msgspec.Struct, frozen=True):
    """One vLLM engine (llm worker) as the orchestrator sees it."""

    ready: bool
    generation: int = 0
    """Bumped each time the engine's worker restarts: gateways fail the streams it held."""


class ClusterStatus(msgspec.Struct, tag="status", frozen=True):
    """orchestrator -> gateways (PUB): whether a new stream can be admitted, and where.

    ``engines[e]`` is engine ``e``'s (``llm.engines`` of them). A stream is placed on a ready
    engine; the node takes streams while at least one engine and the codec are ready."""

    engines: tuple[EngineStatus, ...]
    codec_ready: bool
    draining: bool
    codec_generation: int = 0

    @property
    def llm_ready(self) -> bool:
        """At least one engine can take a stream."""
        return any(e.ready for e in self.engines)

    @property
    def ready_engines(self) -> tuple[bool, ...]:
        return tuple(e.ready for e in self.engines)


class EncodeRequest(msgspec.Struct, tag="encode", frozen=True):
    """gateway -> codec_worker (DEALER -> ROUTER ``layout.encode``): encode a reference clip.

    ``pcm`` is float32 little-endian mono at 24 kHz (already resampled and checked by the
    gateway, which never touches torch)."""

    request_id: int
    pcm: bytes


class EncodeReply(msgspec.Struct, tag="encoded", frozen=True):
    """codec_worker -> gateway: the clip's SNAC code frames (int16 LE, ``(frames, 7)`` in
    Orpheus slot order), or ``error`` (then ``codes`` is empty)."""

    request_id: int
    codes: bytes = b""
    error: str = ""


class DetectRequest(msgspec.Struct, tag="detect", frozen=True):
    """gateway -> codec_worker (DEALER -> ROUTER ``layout.encode``, the socket of
    ``EncodeRequest``): read the watermark of a clip. ``pcm`` is float32 little-endian mono at
    24 kHz (decoded and resampled by the gateway)."""

    request_id: int
    pcm: bytes


class DetectReply(msgspec.Struct, tag="detected", frozen=True):
    """codec_worker -> gateway: the detector's confidence in [0, 1] that the clip is marked,
    and which watermark it reads (``perth``), or ``error`` (then ``score`` is -1)."""

    request_id: int
    score: float = -1.0
    watermark: str = ""
    error: str = ""


CodecRequest = EncodeRequest | DetectRequest


class LoraLoad(msgspec.Struct, tag="lora_load", frozen=True):
    """gateway -> llm_worker (DEALER -> ROUTER ``layout.engine_admin(e)``): load a LoRA voice."""

    request_id: int
    name: str
    path: str
    speaker: str | None = None
    language: str | None = None
    """The voice's language (ISO 639-1), kept in its registry entry."""


class LoraUnload(msgspec.Struct, tag="lora_unload", frozen=True):
    """gateway -> llm_worker: unload a LoRA voice loaded at run time."""

    request_id: int
    name: str


class LoraSync(msgspec.Struct, tag="lora_sync", frozen=True):
    """gateway -> llm_worker: follow the LoRA registry now (another engine's worker loaded or
    unloaded a voice), and answer once done; with several engines a voice loaded through one
    is then usable on every engine."""

    request_id: int


class AdminReply(msgspec.Struct, tag="admin_reply", frozen=True):
    """llm_worker -> gateway: the outcome of an admin request, as an HTTP status."""

    request_id: int
    status: int
    code: str = ""
    message: str = ""


AdminRequest = LoraLoad | LoraUnload | LoraSync
LlmControl = LlmSubmit | LlmAppendText | LlmCancel
OrchestratorMessage = WorkerReady | Heartbeat | WorkerFailed

control_encoder = msgspec.msgpack.Encoder()
# What a msgspec decode raises on bad input: malformed bytes (``DecodeError``) or a
# well-formed value of the wrong shape (``ValidationError``, its subclass, named so the reader
# sees both). Every process's guard around a decode of untrusted bytes catches this.
UNDECODABLE: tuple[type[msgspec.DecodeError], ...] = (msgspec.DecodeError, msgspec.ValidationError)

llm_control_decoder = msgspec.msgpack.Decoder(LlmControl)
orchestrator_decoder = msgspec.msgpack.Decoder(OrchestratorMessage)
status_decoder = msgspec.msgpack.Decoder(ClusterStatus)
encode_request_decoder = msgspec.msgpack.Decoder(EncodeRequest)
codec_request_decoder = msgspec.msgpack.Decoder(CodecRequest)
detect_reply_decoder = msgspec.msgpack.Decoder(DetectReply)
encode_reply_decoder = msgspec.msgpack.Decoder(EncodeReply)
admin_request_decoder = msgspec.msgpack.Decoder(AdminRequest)
admin_reply_decoder = msgspec.msgpack.Decoder(AdminReply)
