"""ElevenLabs' text-to-dialogue: several speakers' turns in one audio stream.

``POST /v1/text-to-dialogue`` and ``.../stream`` answer the audio bytes of ``output_format``;
``.../stream/with-timestamps`` answers JSON lines (base64 audio, ``alignment`` over the text
sent, ``normalized_alignment`` over the text spoken, and each turn's ``voice_segments`` on
the line that ends it); ``.../with-timestamps`` one JSON object with all of them::

    {"inputs": [{"text": "Hi!", "voice_id": "tara"}, {"text": "Hello.", "voice_id": "leo"}],
     "seed": 1, "pronunciation_dictionary_locators": [...], "apply_text_normalization": "on"}

Every turn's voice (built-in, custom or LoRA; at most ``MAX_VOICES`` distinct) and text is
checked before any audio. Turns are spoken in order, a sentence at a time (one request per
sentence, as the streaming TTS), into one encoder, so an MP3 dialogue is one continuous
stream; between turns a pause of silence (``SPEAKER_PAUSE_MS`` when the speaker changes,
``TURN_PAUSE_MS`` when not). The first audio goes out as soon as the first sentence of the
first turn is decoded, with the headers; ``X-Cache`` (``cache_header``) is then the cache
state of the sentences spoken before it (in practice the first turn's first sentence), and
of every sentence of every turn for ``.../with-timestamps``, answered once all is spoken. A
dialogue is one interactive request: all its turns together longer than
``gateway.max_input_chars`` are refused, as one text would be (long-form work belongs in
several requests or a job).
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
from gateway.frontends.elevenlabs.messages import API, HttpAlignment, output_format
from gateway.frontends.elevenlabs.speak import answered, speak_units
from gateway.frontends.shared import UNIT_MAX_CHARS, Handler, abort_of, cache_header, read_body
from gateway.frontends.text_units import UnitSplitter
from gateway.frontends.utterance import pcm_ms
from gateway.link import ClientLink
from gateway.requests import ActiveRequest
from gateway.schemas import SpeechParams, build_params, check_text
from gateway.service import Gateway
from gateway.text.breaks import cap_ms, check_breaks
from gateway.text.plan import TextPlan
from orpheus_wire.text import Locator
from shm.messages import UNDECODABLE, SamplingOverrides
from shm.records import SAMPLE_RATE

PATH = "/v1/text-to-dialogue"
MAX_VOICES = 10
MAX_TURNS = 100
SPEAKER_PAUSE_MS = 350
TURN_PAUSE_MS = 150

_json = msgspec.json.Encoder()


class DialogueInput(msgspec.Struct, kw_only=True):
    text: str
    voice_id: str


class DialogueBody(msgspec.Struct, kw_only=True):
    """The body; ``model_id``, ``settings`` and the other fields of ElevenLabs' that mean
    nothing here are accepted and ignored. ``language_code``: every turn's language (None:
    the first turn's voice's)."""

    inputs: list[DialogueInput]
    seed: int | None = None
    pronunciation_dictionary_locators: list[Locator] | None = None
    apply_text_normalization: str | None = None
    language_code: str | None = None


class VoiceSegment(msgspec.Struct, kw_only=True):
    voice_id: str
    start_time_seconds: float
    end_time_seconds: float
    character_start_index: int
    character_end_index: int
    """Exclusive, into the concatenated ``alignment.characters``."""
    dialogue_input_index: int


class DialogueChunk(msgspec.Struct, kw_only=True):
    """A line of ``.../stream/with-timestamps``, or the whole ``.../with-timestamps`` body."""

    audio_base64: str
    alignment: HttpAlignment | None = None
    normalized_alignment: HttpAlignment | None = None
    voice_segments: list[VoiceSegment] = []


class _Alignment:
    """Characters with absolute times in seconds, built message by message."""

    def __init__(self) -> None:
        self.span_start_ms = 0.0
        self.chars: list[str] = []
        self.starts: list[float] = []
        self.ends: list[float] = []

    def add(self, times: CharTimes | None, audio_ms: float) -> HttpAlignment | None:
        if times is None:
            return None
        s0 = self.span_start_ms
        starts = [round((s0 + s) / 1000, 4) for s in times.charStartTimesMs]
        ends = [
            round((s0 + s + d) / 1000, 4)
            for s, d in zip(times.charStartTimesMs, times.charDurationsMs, strict=True)
        ]
        self.span_start_ms = audio_ms
        self.chars += times.chars
        self.starts += starts
        self.ends += ends
        return HttpAlignment(times.chars, starts, ends)

    def whole(self) -> HttpAlignment:
        return HttpAlignment(self.chars, self.starts, self.ends)


class _Dialogue:
    """One response: the encoder, the clock, the alignments, the segments; written as it
    goes (``stream``) or gathered into one body."""

    def __init__(
        self, request: web.Request, link: ClientLink, fmt: OutputFormat, enc: AudioEncoder,
        *, stream: bool, timestamps: bool,
    ) -> None:  # fmt: skip
        self.request = request
        self.link = link
        self.fmt = fmt
        self.enc = enc
        self.stream = stream
        self.timestamps = timestamps
        self.resp: web.StreamResponse | None = None
        self.audio_ms = 0.0
        self.aligners = UnitAligners("", "")
        self.alignment = _Alignment()
        self.normalized = _Alignment()
        self.segments: list[VoiceSegment] = []
        self.pending_segments: list[VoiceSegment] = []
        self.audio = bytearray()
        """The whole audio, for ``.../with-timestamps`` (not streamed)."""
        self.units: list[ActiveRequest] = []
        """The units whose audio is held (by the encoder, or in ``audio``), not sent yet."""
        self.cache_states: list[str | None] = []
        """The cache state of every unit spoken so far, for ``X-Cache`` (``cache_header``)."""

    async def write(self, data: bytes, n: int = 0, units: Sequence[ActiveRequest] = ()) -> None:
        """``data`` to the client, carrying ``n`` audio bytes of ``units`` (none: a pause)."""
        if self.resp is None:
            json_body = self.timestamps
            self.resp = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": "application/json" if json_body else self.fmt.content_type,
                    "Cache-Control": "no-cache",
                    **cache_header(self.cache_states),
                },
            )
            await self.link.write(self.resp.prepare(self.request))
        await self.link.write(self.resp.write(data), n, units=units)
        if n and units:
            del self.units[:-1]  # the others have their first audio

    async def emit(
        self, data: bytes, times: CharTimes | None, ntimes: CharTimes | None, spoken: bool = True
    ) -> None:
        """Write ``data`` (spoken by the units, or a pause: ``spoken`` false)."""
        units = self.units if spoken else ()
        if not self.timestamps:
            if data:
                await self.write(data, len(data), units)
            return
        al = self.alignment.add(times, self.audio_ms)
        nal = self.normalized.add(ntimes, self.audio_ms)
        if not self.stream:
            self.audio += data
            return
        if data or al is not None or nal is not None or self.pending_segments:
            segments, self.pending_segments = self.pending_segments, []
            chunk = DialogueChunk(
                audio_base64=base64.b64encode(data).decode(),
                alignment=al,
                normalized_alignment=nal,
                voice_segments=segments,
            )
            await self.write(_json.encode(chunk) + b"\n", len(data), units)

    async def deliver(self, unit: ActiveRequest | None, chunks: list[bytes], last: bool) -> None:
        if unit is not None and (not self.units or self.units[-1] is not unit):
            self.units.append(unit)
            self.cache_states.append(unit.cache_state)
        n = sum(map(len, chunks))
        data = b"".join(map(self.enc.encode, chunks))
        self.audio_ms += pcm_ms(n)
        times, ntimes = self.aligners.take(pcm_ms(n), last=last)
        await self.emit(data, times, ntimes)

    async def pause(self, ms: int) -> None:
        n = int(SAMPLE_RATE * ms / 1000) * 2
        data = self.enc.encode(bytes(n))
        self.audio_ms += pcm_ms(n)
        self.alignment.span_start_ms = self.normalized.span_start_ms = self.audio_ms
        await self.emit(data, None, None, spoken=False)

    def end_turn(self, index: int, voice_id: str, start_ms: float, first_char: int) -> None:
        seg = VoiceSegment(
            voice_id=voice_id,
            start_time_seconds=round(start_ms / 1000, 4),
            end_time_seconds=round(self.audio_ms / 1000, 4),
            character_start_index=first_char,
            character_end_index=len(self.alignment.chars),
            dialogue_input_index=index,
        )
        self.segments.append(seg)
        self.pending_segments.append(seg)

    async def finish(self) -> web.StreamResponse:
        tail = self.enc.finish()
        if self.timestamps and not self.stream:
            self.audio += tail
            # A whole WAV file: its sizes are known.
            audio = wav_sized(self.audio) if self.fmt.codec == "wav" else bytes(self.audio)
            body = DialogueChunk(
                audio_base64=base64.b64encode(audio).decode(),
                alignment=self.alignment.whole(),
                normalized_alignment=self.normalized.whole(),
                voice_segments=self.segments,
            )
            # Every unit's audio, after they all ended: written on their behalf.
            await self.write(_json.encode(body), len(self.audio), self.units)
        elif tail or self.pending_segments:
            await self.emit(tail, None, None)
        if self.resp is None:
            await self.write(b"")
        assert self.resp is not None
        await self.link.write(self.resp.write_eof())
        return self.resp


def _templates(
    gateway: Gateway, body: DialogueBody, fmt: OutputFormat, plan: TextPlan | None
) -> list[SpeechParams]:
    """Each turn's template (its voice), everything checked before any audio."""
    cfg = gateway.config
    if not body.inputs:
        raise APIError(400, "invalid_request", "inputs: at least one turn", param="inputs")
    if len(body.inputs) > MAX_TURNS:
        raise APIError(400, "invalid_request", f"inputs: at most {MAX_TURNS} turns", param="inputs")
    voices = {i.voice_id for i in body.inputs}
    if len(voices) > MAX_VOICES:
        raise APIError(
            400,
            "too_many_voices",
            f"inputs: {len(voices)} distinct voices; a dialogue takes at most {MAX_VOICES}",
            param="inputs",
        )
    total = sum(len(i.text) for i in body.inputs)
    limit = cfg.gateway.max_input_chars
    if total > limit:
        raise APIError(
            400,
            "dialogue_too_long",
            f"the dialogue has {total} characters; the limit for one interactive request is "
            f"{limit} (gateway.max_input_chars): split it into several requests (long-form work)",
            param="inputs",
        )
    by_voice: dict[str, SpeechParams] = {}
    out = []
    for n, turn in enumerate(body.inputs):
        # Length: the whole dialogue's bound above covers each turn (one key, checked once).
        check_text(turn.text, None, param=f"inputs[{n}].text")
        check_breaks(turn.text, cap_ms(cfg.gateway.max_break_s), param=f"inputs[{n}].text")
        params = by_voice.get(turn.voice_id)
        if params is None:
            params = by_voice[turn.voice_id] = build_params(
                gateway.voices, gateway.limits, text="", voice=turn.voice_id, max_chars=None,
                text_param="text", allow_empty=True, response_format=fmt.codec,
                sample_rate=fmt.sample_rate, bitrate=fmt.bitrate,
                sampling=SamplingOverrides(seed=body.seed), text_plan=plan,
            )  # fmt: skip
        out.append(params)
    return out


def dialogue_handler(gateway: Gateway, *, stream: bool, timestamps: bool) -> Handler:
    decoder = msgspec.json.Decoder(DialogueBody)

    async def text_to_dialogue(request: web.Request) -> web.StreamResponse:
        started_at = gateway.loop.time()
        cache = of_http(request.headers.get("Cache-Control"), request.query.get("enable_logging"))
        fmt = output_format(request)
        raw = await read_body(request, gateway.config.gateway.max_body_bytes)
        try:
            body = decoder.decode(raw)
        except UNDECODABLE as e:
            raise APIError(400, "invalid_request", f"invalid body: {e}") from None
        language = gateway.languages.resolve(
            body.language_code, body.inputs[0].voice_id if body.inputs else None, "language_code"
        )
        plan = await gateway.speech_text.plan(
            body.pronunciation_dictionary_locators,
            body.apply_text_normalization,
            presented_key(request),
            language,
        )
        templates = _templates(gateway, body, fmt, plan)
        enc = make_output(templates[0].output)

        async def speak_turns(link: ClientLink, out: _Dialogue) -> None:
            first = True
            for n, (turn, template) in enumerate(zip(body.inputs, templates, strict=True)):
                if n > 0:
                    same = body.inputs[n - 1].voice_id == turn.voice_id
                    await out.pause(TURN_PAUSE_MS if same else SPEAKER_PAUSE_MS)
                start_ms, first_char = out.audio_ms, len(out.alignment.chars)
                splitter = UnitSplitter(
                    "sentence", UNIT_MAX_CHARS, None, language=language
                )  # breaks checked
                units = splitter.feed(turn.text) + splitter.flush()
                await speak_units(
                    gateway, template, units, link, out,
                    started_at=started_at if first else None, cache=cache,
                )  # fmt: skip
                first = first and not units
                out.end_turn(n, turn.voice_id, start_ms, first_char)

        try:
            with gateway.links.open(API, abort_of(request), key=presented_key(request)) as link:
                out = _Dialogue(request, link, fmt, enc, stream=stream, timestamps=timestamps)
                return await answered(out, speak_turns(link, out))
        finally:
            enc.close()

    return text_to_dialogue


def routes(gateway: Gateway) -> list[web.RouteDef]:
    return [
        web.post(PATH, dialogue_handler(gateway, stream=False, timestamps=False)),
        web.post(PATH + "/stream", dialogue_handler(gateway, stream=True, timestamps=False)),
        web.post(
            PATH + "/stream/with-timestamps",
            dialogue_handler(gateway, stream=True, timestamps=True),
        ),
        web.post(
            PATH + "/with-timestamps", dialogue_handler(gateway, stream=False, timestamps=True)
        ),
    ]
