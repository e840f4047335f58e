"""How a request becomes ``SpeechParams``: one path for every front end.

Each front end decodes its own wire format (the OpenAI body in ``frontends.openai.body``, ``Speak`` in
``orpheus_wire.zeromq``, the WebSocket protocols' messages) with plain types, then hands the
fields to ``build_params``, which holds every rule about them: the ranges and enums
(``FieldRules``), the sampling fields' limits (``common.limits.RequestLimits``: the
llm_worker checks the same ones with the same function), the text (``check_text``), the voice
(``VoiceCatalog.resolve``: its name, an alias, a voice this server has, looked up as the
llm_worker does) and the format at its sample rate (``output_format``). A bad field therefore
gets the same 400 (code, message, ``param``) through HTTP, every WebSocket protocol and
ZeroMQ, and the whole request is checked before admission, so a bad request is a 400 even
when the server is full: anything the llm_worker would refuse is refused here first.

The OpenAI body is ``gateway.frontends.openai.body``'s.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from common.limits import LimitError, RequestLimits
from gateway.audio.formats import Codec, OutputFormat, SampleRate, check_format, default_rate
from gateway.errors import APIError
from gateway.text.breaks import DEFAULT_MAX_MS, check_breaks, rewrite_runs
from gateway.text.plan import TextPlan
from gateway.voices.catalogue import VoiceCatalog
from orpheus_wire.sampling import LENGTH_FIELD, SamplingFields
from shm.messages import SamplingOverrides
from shm.records import SAMPLE_RATE

StreamFormat = Literal["audio", "sse"]
Speed = Annotated[float, Meta(ge=0.25, le=4.0)]


class VoiceRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenAI's object form of a voice: ``{"id": "..."}``."""

    id: str


class FieldRules(msgspec.Struct, frozen=True, kw_only=True):
    """The rule of each field of the gateway's own that an utterance request may set,
    whatever front end it came through: the one place such a range or enum is written. The
    sampling fields' rules are the llm_worker's too: ``common.limits``. Wire formats declare
    these fields with plain types; ``build_params`` checks their values here."""

    response_format: Codec = "pcm"
    sample_rate: SampleRate | None = None
    speed: Speed = 1.0
    stream_format: StreamFormat = "audio"


def sampling_overrides(fields: SamplingFields, *, length: bool = True) -> SamplingOverrides:
    """The sampling fields of a wire request (any front end's: each inherits
    ``SamplingFields``) as the llm_worker takes them. ``length`` False leaves ``max_tokens``
    out: the streaming protocols speak their text unit by unit, and Baseten's
    ``max_tokens`` is a cap, not a length."""
    o = msgspec.convert(fields, SamplingOverrides, from_attributes=True)
    return o if length else msgspec.structs.replace(o, **{LENGTH_FIELD: None})


class SpeechParams(msgspec.Struct, frozen=True, kw_only=True):
    """A validated utterance request, whatever front end it came from. Made only by
    ``build_params`` (a streaming protocol's units: its template with their text)."""

    text: str
    voice: str
    """The voice as the llm_worker takes it (aliases resolved, known to this server)."""
    sampling: SamplingOverrides = SamplingOverrides()
    response_format: Codec = "pcm"
    sample_rate: int = SAMPLE_RATE
    bitrate: str | None = None
    """Of a lossy codec (ElevenLabs' ``mp3_44100_128``); None: the codec's default."""
    speed: float = 1.0
    stream_format: StreamFormat = "audio"
    text_plan: TextPlan | None = None
    """What is done to the text before the model reads it (dictionaries, normalisation;
    ``gateway.text``); None: nothing, or done already (``spoken``)."""

    @property
    def output(self) -> OutputFormat:
        return OutputFormat(self.response_format, self.sample_rate, self.bitrate)

    def spoken(self) -> SpeechParams:
        """These params with ``text`` rewritten by ``text_plan`` (once: the result has no
        plan). Applied to a whole request's text or to a whole unit of a streamed one; the
        runs between break tags are rewritten each on its own, the tags kept
        (``gateway.text.breaks``)."""
        if self.text_plan is None:
            return self
        text = rewrite_runs(self.text, self.text_plan.apply)
        return msgspec.structs.replace(self, text=text, text_plan=None)


def output_format(
    codec: Codec, sample_rate: int | None, bitrate: str | None = None
) -> OutputFormat:
    """The ``OutputFormat`` of an OpenAI-style ``response_format`` + ``sample_rate``;
    APIError 400 for a pair this server cannot make (``opus`` at 22050 Hz, ...)."""
    rate = sample_rate or default_rate(codec)
    fmt = OutputFormat(codec, rate, bitrate)
    try:
        check_format(fmt)
    except ValueError as e:
        raise bad_request(f"{codec} at {rate} Hz: {e}", param="sample_rate") from None
    return fmt


def bad_request(
    message: str, *, code: str = "invalid_request", param: str | None = None
) -> APIError:
    return APIError(400, code, message, param=param)


_PATH_RE = re.compile(r"at `\$\.([A-Za-z_]+)")
_FIELD_RE = re.compile(r"field `([A-Za-z_]+)`")


def param_of(err: msgspec.ValidationError) -> str | None:
    """The top-level field a msgspec error is about (``param`` of the JSON error)."""
    m = _PATH_RE.search(str(err)) or _FIELD_RE.search(str(err))
    return m.group(1) if m else None


def check_text(
    text: str, max_chars: int | None, *, param: str = "input", allow_empty: bool = False
) -> str:
    """The rule of any text a client sends (a whole input or a streamed piece of one):
    not blank unless ``allow_empty``, at most ``max_chars`` (None: no limit here; a
    streaming protocol bounds its units), no NUL. ``param``: the field as the protocol
    names it."""
    if not allow_empty and not text.strip():
        raise bad_request(f"`{param}` must contain some text", code="empty_input", param=param)
    if max_chars is not None and len(text) > max_chars:
        raise bad_request(
            f"`{param}` has {len(text)} characters; the limit is {max_chars}",
            code="input_too_long",
            param=param,
        )
    if "\x00" in text:
        raise bad_request(f"`{param}` contains a NUL character", param=param)
    return text


def build_params(
    voices: VoiceCatalog,
    limits: RequestLimits,
    *,
    text: str,
    voice: str | None,
    max_chars: int | None,
    text_param: str = "input",
    allow_empty: bool = False,
    response_format: str = "pcm",
    sample_rate: int | None = None,
    bitrate: str | None = None,
    speed: float | None = None,
    stream_format: str = "audio",
    sampling: SamplingOverrides | None = None,
    text_open: bool = False,
    text_plan: TextPlan | None = None,
    max_break_ms: int = DEFAULT_MAX_MS,
) -> SpeechParams:
    """The one way a request becomes ``SpeechParams``, whatever front end it came through.

    Checked in this order, each failure an ``APIError`` 400 that is the same everywhere:
    the fields' values (``FieldRules``, then the sampling fields' ``limits``, with
    ``text_open``: the request's text is open, ZeroMQ's; ``param`` names the field), the
    text (``check_text``), the voice (``voices.resolve``; None: the default voice, "" is not
    a name), the format at its rate (``output_format``). ``speed`` None: 1.0. ``bitrate`` is
    not the client's (ElevenLabs' named formats carry one). ``text_plan``
    (``gateway.text.service.SpeechText.plan``, resolved by the front end) is carried, not
    applied: ``SpeechParams.spoken`` applies it to whole units of text. A streaming protocol builds a
    template with ``text=""``, ``allow_empty=True`` and speaks each unit with its text.
    Break tags in a whole text (not ``text_open``'s, which may end inside one) are checked
    against ``max_break_ms`` (``gateway.max_break_s``) here: a malformed or too long one is
    a 400 (``gateway.text.breaks``); they stay in ``text`` (the request's runs and pauses).
    """
    given = {
        "response_format": response_format,
        "sample_rate": sample_rate,
        "speed": speed,
        "stream_format": stream_format,
    }
    try:
        f = msgspec.convert({k: v for k, v in given.items() if v is not None}, FieldRules)
        checked = limits.check(sampling or SamplingOverrides(), text_open=text_open)
    except msgspec.ValidationError as e:
        raise bad_request(str(e), param=param_of(e)) from None
    except LimitError as e:
        raise bad_request(e.message, param=e.param) from None
    text = check_text(text, max_chars, param=text_param, allow_empty=allow_empty)
    if not text_open and not check_breaks(text, max_break_ms, param=text_param) and text:
        if not allow_empty:
            raise bad_request(
                f"`{text_param}` has only break tags: there is nothing to say",
                code="empty_input",
                param=text_param,
            )
    model_voice = voices.resolve(voices.default if voice is None else voice)
    fmt = output_format(f.response_format, f.sample_rate, bitrate)
    return SpeechParams(
        text=text,
        voice=model_voice,
        sampling=checked,
        response_format=f.response_format,
        sample_rate=fmt.sample_rate,
        bitrate=bitrate,
        speed=f.speed,
        stream_format=f.stream_format,
        text_plan=text_plan,
    )
