"""ElevenLabs' text-to-speech over HTTP, streamed and whole.

``POST /v1/text-to-speech/{voice_id}/stream`` answers the audio bytes of ``output_format``;
``POST .../stream/with-timestamps`` answers JSON lines, each with base64 audio and the
estimated character times of the text it speaks (``gateway.frontends.alignment``). The
text is spoken a sentence at a time, one request per sentence, into one continuous encoded
stream; the status is decided by the first sentence (an error before any audio is JSON
with its status), a failure after the headers cuts the connection. ``X-Cache`` goes out
with the headers: the cache state of the sentences spoken before the first bytes
(``cache_header``; in practice the first sentence).

``POST /v1/text-to-speech/{voice_id}`` (the SDK's ``convert``) and ``.../with-timestamps``
(``convert_with_timestamps``) speak the same way and answer once all of it is spoken: the
whole audio (with its ``Content-Length``; a WAV file with its real sizes in its header), or one JSON object with the whole audio in
base64 and the alignments of all its characters; a failure anywhere is a JSON error with
its status. Their ``X-Cache`` is of all the sentences.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import msgspec
from aiohttp import web

from gateway.audio.encoders import AudioEncoder, wav_sized
from gateway.audio.formats import OutputFormat
from gateway.audio.output import make_output
from gateway.cache.control import of_http
from gateway.edge.auth import presented_key
from gateway.errors import APIError
from gateway.frontends.alignment import CharTimes, UnitAligners
from gateway.frontends.elevenlabs.messages import (
    API,
    HttpAlignment,
    SpeechBody,
    TimestampChunk,
    WholeTimestamps,
    output_format,
    params_for,
    refuse_unsupported,
)
from gateway.frontends.elevenlabs.speak import answered, speak_units
from gateway.frontends.shared import UNIT_MAX_CHARS, Handler, abort_of, cache_header, read_body
from gateway.frontends.text_units import UnitSplitter
from gateway.frontends.utterance import pcm_ms
from gateway.link import ClientLink
from gateway.requests import ActiveRequest
from gateway.service import Gateway
from gateway.text.breaks import cap_ms
from shm.messages import UNDECODABLE

_json = msgspec.json.Encoder()


class _HttpStream:
    """One response: its link, its encoder, its headers (sent with the first bytes) and its
    clock."""

    def __init__(
        self, request: web.Request, link: ClientLink, fmt: OutputFormat, enc: AudioEncoder,
        timestamps: bool, whole: bool = False,
    ) -> None:  # fmt: skip
        self.request = request
        self.link = link
        self.fmt = fmt
        self.enc = enc
        self.timestamps = timestamps
        self.whole = whole
        """Answer once all is spoken (``convert``): the audio and alignment are gathered."""
        self.audio = bytearray()
        """Whole: the encoded audio so far."""
        self.gathered = (HttpAlignment([], [], []), HttpAlignment([], [], []))
        """Whole, with timestamps: the alignment and the normalized alignment so far."""
        self.resp: web.StreamResponse | None = None
        self.audio_ms = 0.0
        """Audio encoded so far, in ms of 24 kHz PCM."""
        self.span_start = [0.0, 0.0]
        """Where the text of the next timestamped line starts, in ms (alignment, normalized)."""
        self.aligners = UnitAligners("", "")
        """The character times of the unit being spoken (set before each unit)."""
        self.units: list[ActiveRequest] = []
        """The units whose audio the encoder may hold, not sent yet (the last: the latest)."""
        self.cache_states: list[str | None] = []
        """The cache state of every unit spoken so far, for ``X-Cache`` (``cache_header``)."""

    async def write(self, data: bytes, n: int = 0, units: Sequence[ActiveRequest] = ()) -> None:
        """``data`` to the client, carrying ``n`` audio bytes of ``units`` (whole: gathered,
        counted as delivered)."""
        if self.whole:
            self.audio += data
            self.link.wrote(n, units=units)
            if n:
                del self.units[:-1]
            return
        if self.resp is None:
            self.resp = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": "application/json"
                    if self.timestamps
                    else self.fmt.content_type,
                    "Cache-Control": "no-cache",
                    **cache_header(self.cache_states),
                },
            )
            await self.link.write(self.resp.prepare(self.request))
        await self.link.write(self.resp.write(data), n, units=units)
        if n:
            del self.units[:-1]  # the others have their first audio

    def _alignment(self, times: CharTimes | None, which: int) -> HttpAlignment | None:
        if times is None:
            return None
        start = self.span_start[which]
        starts = [round((start + s) / 1000, 4) for s in times.charStartTimesMs]
        ends = [
            round((start + s + d) / 1000, 4)
            for s, d in zip(times.charStartTimesMs, times.charDurationsMs, strict=True)
        ]
        self.span_start[which] = self.audio_ms
        return HttpAlignment(times.chars, starts, ends)

    def _alignments(
        self, times: CharTimes | None, normalized: CharTimes | None
    ) -> tuple[HttpAlignment | None, HttpAlignment | None]:
        al = self._alignment(times, 0)
        nal = al if normalized is times else self._alignment(normalized, 1)
        if normalized is times:
            self.span_start[1] = self.span_start[0]
        return al, nal

    def line(
        self, data: bytes, times: CharTimes | None, normalized: CharTimes | None = None
    ) -> bytes:
        al, nal = self._alignments(times, normalized)
        chunk = TimestampChunk(base64.b64encode(data).decode() if data else None, al, nal)
        return _json.encode(chunk) + b"\n"

    def gather(self, times: CharTimes | None, normalized: CharTimes | None) -> None:
        """Whole: add the character times of the audio just encoded."""
        for got, into in zip(self._alignments(times, normalized), self.gathered, strict=True):
            if got is not None:
                into.characters.extend(got.characters)
                into.character_start_times_seconds.extend(got.character_start_times_seconds)
                into.character_end_times_seconds.extend(got.character_end_times_seconds)

    async def deliver(self, unit: ActiveRequest | None, chunks: list[bytes], last: bool) -> None:
        """Encode and write one batch of the current unit's PCM (or a pause's silence)."""
        if unit is not None and (not self.units or self.units[-1] is not unit):
            self.units.append(unit)
            self.cache_states.append(unit.cache_state)
        n = sum(map(len, chunks))
        enc = self.enc.encode
        data = b"".join(map(enc, chunks))
        self.audio_ms += pcm_ms(n)
        if not self.timestamps:
            if data:
                await self.write(data, len(data), self.units)
            return
        times, normalized = self.aligners.take(pcm_ms(n), last=last)
        if self.whole:
            self.gather(times, normalized)
            await self.write(data, len(data), self.units)
        elif data or times is not None or normalized is not None:
            await self.write(self.line(data, times, normalized), len(data), self.units)

    async def finish(self) -> web.StreamResponse:
        """The encoder's tail (the last units' audio, after they ended), then the end."""
        tail = self.enc.finish()
        if tail:
            line = self.line(tail, None) if self.timestamps and not self.whole else tail
            await self.write(line, len(tail), self.units)
        if self.whole:
            return await self._send_whole()
        if self.resp is None:
            await self.write(b"")
        assert self.resp is not None
        await self.link.write(self.resp.write_eof())
        return self.resp

    async def _send_whole(self) -> web.StreamResponse:
        # A whole WAV file: its sizes are known.
        audio = wav_sized(self.audio) if self.fmt.codec == "wav" else bytes(self.audio)
        if self.timestamps:
            al, nal = self.gathered
            body = _json.encode(WholeTimestamps(base64.b64encode(audio).decode(), al, nal))
            content_type = "application/json"
        else:
            body, content_type = audio, self.fmt.content_type
        headers = {"Content-Type": content_type, **cache_header(self.cache_states)}
        self.resp = web.StreamResponse(status=200, headers=headers)
        self.resp.content_length = len(body)
        await self.link.write(self.resp.prepare(self.request))
        await self.link.write(self.resp.write(body))
        await self.link.write(self.resp.write_eof())
        return self.resp


def stream_handler(gateway: Gateway, *, timestamps: bool, whole: bool = False) -> Handler:
    """``POST .../stream`` (audio bytes) and ``.../stream/with-timestamps`` (JSON lines);
    ``whole``: ``POST /v1/text-to-speech/{voice_id}`` and ``.../with-timestamps``."""
    g = gateway.config.gateway
    decoder = msgspec.json.Decoder(SpeechBody)

    async def tts_stream(request: web.Request) -> web.StreamResponse:
        started_at = gateway.loop.time()
        fmt = output_format(request)
        body = await read_body(request, g.max_body_bytes)
        try:
            req = decoder.decode(body)
        except UNDECODABLE as e:
            raise APIError(400, "invalid_request", f"invalid body: {e}") from None
        refuse_unsupported(req)
        language = gateway.languages.resolve(
            req.language_code, request.match_info["voice_id"], "language_code"
        )
        plan = await gateway.speech_text.plan(
            req.pronunciation_dictionary_locators,
            req.apply_text_normalization,
            presented_key(request),
            language,
        )
        params = params_for(
            request, gateway, fmt, text=req.text, max_chars=g.max_input_chars,
            speed=req.voice_settings.speed if req.voice_settings else None, seed=req.seed,
            text_plan=plan,
        )  # fmt: skip
        splitter = UnitSplitter(
            "sentence", UNIT_MAX_CHARS, cap_ms(g.max_break_s), language=language
        )
        units = splitter.feed(params.text) + splitter.flush()
        cache = of_http(request.headers.get("Cache-Control"), request.query.get("enable_logging"))
        enc = make_output(params.output, params.speed)
        try:
            with gateway.links.open(API, abort_of(request), key=presented_key(request)) as link:
                out = _HttpStream(request, link, fmt, enc, timestamps, whole)
                return await answered(out, speak_units(
                    gateway, params, units, link, out, started_at=started_at, cache=cache,
                ))  # fmt: skip
        finally:
            enc.close()

    return tts_stream
