"""vLLM-Omni's streaming speech WebSocket at ``/v1/audio/speech/stream``.

The protocol of ``vllm_omni/entrypoints/openai/serving_speech_stream.py`` (vLLM's own
speech server), so its clients (LiveKit's Baseten plugin with ``model="qwen3-tts"``, the
vLLM-Omni examples) work pointed at this server::

    client: {"type": "session.config", "voice": "tara", "response_format": "pcm",
             "stream_audio": true, ...}            first; a later one replaces it
    client: {"type": "input.text", "text": "Hello "}   ... pieces of text ...
    client: {"type": "input.done"}                 flush: speak what is buffered
    server: {"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
             "sentence_text": "...", "format": "pcm", "sample_rate": 24000, "channels": 1}
    server: <binary audio> ...
    server: {"type": "audio.done", "utterance_index": 0, "sentence_index": 0,
             "total_bytes": N, "error": false}
    server: {"type": "session.done", "utterance_index": 0, "total_sentences": 1}
    client: ... next utterance on the same socket ..., {"type": "session.close"}

``split_granularity`` is vLLM-Omni's: ``none`` (its default: a flush is one unit,
``sentence_index`` 0 of ``total_sentences`` 1), ``sentence`` or ``clause``, with its rules
(``gateway.frontends.omni.units``). Whatever the client is shown, the gateway speaks sentences as soon
as they are complete, each its own stream, never across a shown unit's boundary: a shown
unit's audio is held until its text is complete (``audio.start`` carries it), then sent in
order. Differences from vLLM-Omni, all additive: ``sample_rate`` and the formats
``ulaw``/``alaw`` reach telephony;
``stream_audio`` also streams ``ulaw``/``alaw``; ``word_timestamps`` and Baseten's
``timestamp_type: "word"`` carry the gateway's *estimated* word times
(``gateway.frontends.alignment``), there being no forced aligner. A client that closes the socket
cancels the work in flight all the way into vLLM (this is how LiveKit's plugin barges in).
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import msgspec
from aiohttp import WSMsgType, web

from gateway.apis import Api
from gateway.audio.encoders import AudioEncoder
from gateway.audio.formats import RAW
from gateway.audio.output import make_output
from gateway.cache.control import USE, CacheUse, combined, of_header
from gateway.disclosure.headers import watermark_of
from gateway.edge.auth import presented_key
from gateway.errors import APIError
from gateway.frontends.alignment import WordTime, word_times
from gateway.frontends.omni.messages import (
    AudioChunk,
    AudioDone,
    AudioStart,
    ErrorMessage,
    SessionConfig,
    SessionDone,
    TimestampInfo,
    WordAlignment,
)
from gateway.frontends.omni.units import Event, OmniUnits, Speak
from gateway.frontends.shared import (
    UNIT_MAX_CHARS,
    Handler,
    api_error,
    send_json,
    send_json_quietly,
    stream_template,
)
from gateway.frontends.text_units import Unit
from gateway.frontends.utterance import (
    Lane,
    QueueCap,
    drain_while_open,
    pcm_ms,
    receive_unless_idle,
    serve_websocket,
    speak_unit,
)
from gateway.link import ClientLink
from gateway.requests import ActiveRequest
from gateway.schemas import SpeechParams, check_text, sampling_overrides
from gateway.service import Gateway
from gateway.streams import StreamFailed
from gateway.text.breaks import BreakError, cap_ms

log = logging.getLogger(__name__)

PATH = "/v1/audio/speech/stream"
API = Api.OMNI

_any = msgspec.json.Decoder()
_json = msgspec.json.Encoder()


class _OmniConnection:
    """One vLLM-Omni socket: its configuration, its lane of units, what the client is shown."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        link: ClientLink,
        gateway: Gateway,
        key: str | None = None,
        cache: CacheUse = USE,
    ) -> None:
        self.ws = ws
        self.cache = cache
        """What its units let the sentence audio cache do (the upgrade's Cache-Control)."""
        self.link = link
        """Every write to the client (``gateway.link``)."""
        self.key = key
        """The API key the connection presented (whose dictionaries it may use)."""
        self.gateway = gateway
        self.watermark = watermark_of(gateway.config)
        g = gateway.config.gateway
        self.cap = QueueCap(g.ws_max_queued_chars, g.ws_max_queued_sentences)
        self.lane = Lane("omni-session", self.cap)
        self.config: SessionConfig | None = None
        self.params: SpeechParams | None = None
        """The session's template: voice, format, speed, sampling (``build_params``)."""
        self.units = OmniUnits()
        self.shown: _Shown | None = None
        """The shown unit being built (its spoken units queued, its text not complete)."""
        self.stream_encoder: AudioEncoder | None = None
        """One encoder for the whole session when audio streams (continuous resampling)."""
        self.file_encoder: AudioEncoder | None = None
        """The file of the shown unit being spoken, when audio does not stream."""
        self.utterance = 0
        self.sentence = 0
        self.utterance_open = False

    async def send(self, msg: msgspec.Struct) -> None:
        await send_json(self.link, self.ws, msg)

    async def error(self, message: str, code: str | None = None, **kw: Any) -> None:
        await send_json_quietly(self.link, self.ws, ErrorMessage(message, code, **kw))

    # -- client messages -------------------------------------------------------------------
    async def apply_config(self, raw: dict[str, Any]) -> bool:
        if self.utterance_open:
            await self.error(
                "session.config cannot be applied while an utterance is in progress; "
                "send input.done first",
                "utterance_in_progress",
            )
            return False
        try:
            cfg = msgspec.convert(
                {k: v for k, v in raw.items() if k != "type"}, SessionConfig, strict=True
            )
        except msgspec.ValidationError as e:
            await self.error(f"Invalid session config: {e}", "invalid_config")
            return False
        g = self.gateway
        try:
            language = g.languages.resolve(cfg.language, cfg.voice or cfg.speaker or None)
            plan = await g.speech_text.plan(
                cfg.pronunciation_dictionary_locators,
                cfg.apply_text_normalization,
                self.key,
                language,
            )
            params = stream_template(
                g,
                text_plan=plan,
                voice=cfg.voice or cfg.speaker or None,
                response_format=cfg.response_format,
                sample_rate=cfg.sample_rate,
                speed=cfg.speed,
                sampling=sampling_overrides(cfg, length=False),
            )
            codec = params.response_format
            if cfg.stream_audio and codec not in RAW:
                raise ValueError(
                    "stream_audio=true needs response_format 'pcm' (or 'ulaw'/'alaw'), "
                    f"got {codec!r}"
                )
            if cfg.word_timestamps and not (cfg.stream_audio and codec == "pcm"):
                raise ValueError("word_timestamps=true requires stream_audio=true and 'pcm'")
        except ValueError as e:
            await self.error(f"Invalid session config: {e}", "invalid_config")
            return False
        except APIError as e:
            await self.error(f"Invalid session config: {e.message}", e.code)
            return False
        self.config = cfg
        self.params = params
        g = self.gateway.config.gateway
        self.units = OmniUnits(
            cfg.split_granularity,
            UNIT_MAX_CHARS,
            g.max_input_chars,
            cap_ms(g.max_break_s),
            language,
        )
        old, self.stream_encoder = self.stream_encoder, None
        if old is not None:
            self.lane.push(self._closer(old))
        return True

    @staticmethod
    def _closer(enc: AudioEncoder) -> Any:
        async def close() -> None:
            enc.close()

        return close

    def queue(self, events: list[Event]) -> None:
        """Queue the spoken units of ``events`` on the lane; a ``Close`` makes its shown unit's
        text known at once (the audio held for it goes out with its next delivery) and
        queues the shown unit's end behind its spoken units."""
        for ev in events:
            shown = self.shown
            if shown is None:
                cfg, params = self.config, self.params
                assert cfg is not None and params is not None
                shown = self.shown = _Shown(self.utterance, ev.shown, cfg, params)
            if isinstance(ev, Speak):
                self.lane.push(self._speak_job(ev.unit, shown), len(ev.unit.text))
            else:
                shown.text = ev.text
                self.shown = None
                self.sentence += 1
                self.lane.push(self._end_job(shown))

    def input_done(self) -> None:
        self.queue(self.units.flush())
        done = SessionDone(self.utterance, self.sentence)

        async def job() -> None:
            # One stream encoder per utterance: the next one starts clean. The resampler's
            # last few samples (under 1 ms) are dropped rather than sent outside a sentence.
            enc, self.stream_encoder = self.stream_encoder, None
            if enc is not None:
                enc.close()
            await send_json_quietly(self.link, self.ws, done)

        self.lane.push(job)
        self.utterance += 1
        self.sentence = 0
        self.utterance_open = False

    # -- speaking ----------------------------------------------------------------------------
    def _encoder(self, shown: _Shown) -> AudioEncoder:
        """The session's stream encoder (``stream_audio``), else the shown unit's file's."""
        fmt, speed = shown.params.output, shown.params.speed
        if shown.streaming:
            if self.stream_encoder is None:
                self.stream_encoder = make_output(fmt, speed)
            return self.stream_encoder
        if self.file_encoder is None:
            self.file_encoder = make_output(fmt, speed)
        return self.file_encoder

    async def _send_start(self, shown: _Shown) -> None:
        """``audio.start``, once: when the unit's text is known and (streamed audio) its first
        audio is, or (a file) before it is spoken."""
        if shown.text is not None and not shown.start_sent:
            shown.start_sent = True
            fmt = shown.params.output
            raw = fmt.codec in RAW
            await self.send(
                AudioStart(shown.utt, shown.index, shown.text, fmt.codec,
                           fmt.sample_rate if raw else None, 1 if raw else None,
                           shown.config.word_timestamps, ai_generated=True,
                           watermark=self.watermark)
            )  # fmt: skip

    async def _release(self, shown: _Shown) -> None:
        """Send ``audio.start`` and the audio held for ``shown``, once its text is known (a
        streamed unit's as it comes, a file at its end), on behalf of the units that made
        it (their time to first audio, also for those that ended meanwhile)."""
        if shown.text is None:
            return
        await self._send_start(shown)
        held, shown.held = shown.held, []
        ws, write = self.ws, self.link.write
        for data, start_ms, end_ms in held:
            units = shown.units
            if shown.config.word_timestamps:
                chunk = AudioChunk(shown.utt, shown.index, shown.chunk_id, start_ms, end_ms,
                                   shown.params.output.sample_rate, 1,
                                   base64.b64encode(data).decode("ascii"), None)  # fmt: skip
                if ws.closed:
                    return
                await write(ws.send_str(_json.encode(chunk).decode()), len(data), units=units)
                shown.chunk_id += 1
            else:
                await write(ws.send_bytes(data), len(data), units=units)
            shown.units = units[-1:]  # the others have their first audio
            shown.total += len(data)

    def _speak_job(self, unit: Unit, shown: _Shown) -> Any:
        started_at = self.gateway.loop.time()

        async def job() -> None:
            if shown.failure is not None:
                return  # its shown unit already failed: the rest of it is not spoken
            enc = self._encoder(shown)
            unit_start = shown.pcm_bytes
            if not shown.streaming:
                await self._send_start(shown)

            async def deliver(
                active: ActiveRequest | None, chunks: list[bytes], last: bool
            ) -> None:
                if active is not None and (not shown.units or shown.units[-1] is not active):
                    shown.units.append(active)
                if active is not None and active is not shown.cached_from:
                    shown.cached_from = active
                    shown.cache_states.append(active.cache_state)
                start_ms = round(pcm_ms(shown.pcm_bytes))
                for c in chunks:
                    shown.pcm_bytes += len(c)
                data = b"".join(map(enc.encode, chunks))
                if data:
                    shown.held.append((data, start_ms, round(pcm_ms(shown.pcm_bytes))))
                if shown.streaming:
                    await self._release(shown)

            try:
                await speak_unit(
                    self.gateway, shown.params, unit.text, self.link, deliver,
                    started_at=started_at, pause_ms=unit.pause_ms, cache=self.cache,
                )  # fmt: skip
            except (APIError, StreamFailed) as e:
                shown.failure = api_error(e)
                return
            offset = round(pcm_ms(unit_start))
            shown.words += [
                WordTime(w.word, w.start_ms + offset, w.end_ms + offset)
                for w in word_times(unit.raw, pcm_ms(shown.pcm_bytes - unit_start), unit.pause_ms)
            ]

        return job

    def _end_job(self, shown: _Shown) -> Any:
        """After the shown unit's spoken units: the rest of its audio (a file: all of it),
        its error if one failed, ``audio.done``."""

        async def job() -> None:
            cfg, fmt = shown.config, shown.params.output
            failed = shown.failure is not None
            if not shown.streaming:
                enc, self.file_encoder = self.file_encoder, None
                try:
                    if failed:
                        shown.held = []
                    elif enc is not None:
                        tail = enc.finish()
                        data = b"".join(d for d, _, _ in shown.held) + tail
                        shown.held = [(data, 0, round(pcm_ms(shown.pcm_bytes)))] if data else []
                finally:
                    if enc is not None:
                        enc.close()
            elif failed:
                shown.held = []  # audio of a failed unit not sent yet is dropped
            await self._release(shown)  # after its units ended: still on their behalf
            err = shown.failure
            if err is not None:
                await self.error(
                    f"Generation failed for utterance {shown.utt}, sentence {shown.index}: "
                    f"{err.message}",
                    err.code,
                    partial_audio=shown.total > 0,
                    action="discard" if shown.total > 0 else None,
                )
            words = [] if failed else shown.words
            end_ms = round(pcm_ms(shown.pcm_bytes))
            if cfg.word_timestamps:
                stamps = [
                    {"word": w.word, "start_ms": w.start_ms, "end_ms": w.end_ms} for w in words
                ]
                await self.send(
                    AudioChunk(shown.utt, shown.index, shown.chunk_id, 0, end_ms,
                               fmt.sample_rate, 1, "", None if failed else stamps)
                )  # fmt: skip
            info: TimestampInfo | None = None
            if cfg.timestamp_type == "word" and not failed:
                info = TimestampInfo(
                    WordAlignment(
                        [w.word for w in words],
                        [w.start_ms / 1000 for w in words],
                        [w.end_ms / 1000 for w in words],
                    )
                )
            cache = combined(shown.cache_states)
            await self.send(AudioDone(shown.utt, shown.index, shown.total, failed, info, cache))

        return job


class _Shown:
    """One unit as the client sees it (``audio.start`` ... ``audio.done``), made of one or
    more spoken units (``gateway.frontends.omni.units``)."""

    def __init__(self, utt: int, index: int, config: SessionConfig, params: SpeechParams) -> None:
        self.utt = utt
        self.index = index
        self.config = config
        self.params = params
        self.streaming = config.stream_audio
        self.text: str | None = None
        """Known when the unit is complete (``Close``); its audio is held until then."""
        self.start_sent = False
        self.held: list[tuple[bytes, int, int]] = []
        """Encoded audio not sent yet, with its span (ms from the unit's start)."""
        self.total = 0
        """Audio bytes sent (``audio.done``'s ``total_bytes``)."""
        self.pcm_bytes = 0
        """24 kHz PCM spoken so far: the unit's clock."""
        self.chunk_id = 0
        self.units: list[ActiveRequest] = []
        """The spoken units whose audio is held, not sent yet (the last: the latest unit)."""
        self.words: list[WordTime] = []
        self.failure: APIError | None = None
        self.cache_states: list[str | None] = []
        """Each spoken unit's cache state (``audio.done``'s ``cache``)."""
        self.cached_from: ActiveRequest | None = None
        """The spoken unit whose state was taken last."""


async def _serve(
    ws: web.WebSocketResponse, link: ClientLink, request: web.Request, gateway: Gateway
) -> None:
    g = gateway.config.gateway
    s = _OmniConnection(
        ws, link, gateway, presented_key(request), of_header(request.headers.get("Cache-Control"))
    )
    try:
        while True:
            try:
                if s.config is None:
                    msg = await ws.receive(g.ws_start_timeout_s)
                else:  # an open utterance does not hold the socket: only activity does
                    msg = await receive_unless_idle(
                        ws, g.ws_text_idle_timeout_s, lambda: s.lane.quiet_since
                    )
            except TimeoutError:
                await s.error(
                    "Timeout waiting for session.config"
                    if s.config is None
                    else "Idle timeout: no message received",
                    "timeout",
                )
                break
            if msg.type == WSMsgType.BINARY:
                await s.error("binary messages are not accepted; send JSON text", "invalid_message")
                continue
            if msg.type != WSMsgType.TEXT:
                await s.lane.cancel()  # the client went away: stop the work in flight
                return
            try:
                raw = _any.decode(msg.data)
            except msgspec.DecodeError:
                await s.error("Invalid JSON message", "invalid_json")
                if s.config is None:
                    break
                continue
            if not isinstance(raw, dict):
                await s.error("WebSocket messages must be JSON objects", "invalid_message")
                continue
            kind = raw.get("type")
            if kind == "session.config":
                if not await s.apply_config(raw) and s.config is None:
                    break
            elif s.config is None:
                await s.error(f"Expected session.config, got: {kind}", "invalid_message")
                break
            elif kind == "input.text":
                text = raw.get("text", "")
                if not isinstance(text, str):
                    await s.error("input.text requires a string value", "invalid_message")
                    continue
                try:
                    check_text(text, None, param="text", allow_empty=True)
                except APIError as e:
                    await s.error(e.message, e.code)
                    continue
                if text and not s.cap.admits(s.units.pending_chars, len(text)):
                    await s.error(s.cap.refusal(), "input_queue_full")
                    continue
                if text:
                    s.utterance_open = True
                try:
                    s.queue(s.units.feed(text))
                except BreakError as e:  # a bad break tag: refused from the tag on
                    await s.error(e.message, e.code)
            elif kind == "input.done":
                try:
                    s.input_done()
                except BreakError as e:  # a break tag that never closed
                    await s.error(e.message, e.code)
            elif kind == "session.close":
                # What was flushed is delivered, then the socket closes.
                await drain_while_open(ws, s.lane)
                break
            else:
                await s.error(f"Unknown message type: {kind}", "invalid_message")
    finally:
        await s.lane.cancel()
        for enc in (s.stream_encoder, s.file_encoder):
            if enc is not None:
                enc.close()
    if not ws.closed:
        await link.write(ws.close())


def routes(gateway: Gateway) -> list[web.RouteDef]:
    return [web.get(PATH, speech_stream_handler(gateway))]


def speech_stream_handler(gateway: Gateway) -> Handler:
    async def speech_stream(request: web.Request) -> web.WebSocketResponse:
        return await serve_websocket(
            request, gateway, API, lambda ws, link: _serve(ws, link, request, gateway)
        )

    return speech_stream
