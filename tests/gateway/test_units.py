"""Gateway building blocks in isolation: validation, voices, admission, the stream
registry's routing of ring records, the audio encoders, SSE and ZeroMQ framing."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import av
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from common.config.gateway import OPENAI_VOICES
from common.limits import RequestLimits
from gateway.admission.queue import Admission
from gateway.audio.encoders import ENCODER_FORMATS, tempo_factors, wav_header
from gateway.audio.formats import OutputFormat
from gateway.audio.output import make_output
from gateway.errors import APIError
from gateway.frontends.openai.body import decode_speech_request, speech_params
from gateway.frontends.openai.sse import delta_event, done_event
from gateway.metrics import GatewayMetrics
from gateway.streams import PcmStream, StreamFailed, StreamRegistry
from gateway.voices.catalogue import ENGLISH_VOICES, VoiceCatalog
from orpheus_wire.zeromq import endpoint_for
from shm.messages import LlmCancel, llm_control_decoder
from shm.records import RecordKind, StreamEnd, StreamError, gateway_of, record_encoder
from shm.ring import Record

VOICES = VoiceCatalog(OPENAI_VOICES, list(ENGLISH_VOICES), "tara")
LIMITS = RequestLimits()


def _params(body: dict) -> object:
    return speech_params(decode_speech_request(json.dumps(body).encode()), VOICES, LIMITS, 100)


# -- request validation ----------------------------------------------------------------------
def test_openai_request_maps_aliases_and_sampling() -> None:
    p = _params(
        {"model": "gpt-4o-mini-tts", "input": "Hi", "voice": "Alloy", "response_format": "wav",
         "speed": 1.0, "max_tokens": 700, "seed": 3, "temperature": 0.5, "top_p": 0.9,
         "repetition_penalty": 1.2, "instructions": "cheerful"}
    )  # fmt: skip
    assert p.voice == "tara" and p.response_format == "wav" and p.stream_format == "audio"
    s = p.sampling
    assert (s.max_tokens, s.seed, s.temperature, s.top_p, s.repetition_penalty) == (
        700, 3, 0.5, 0.9, 1.2,
    )  # fmt: skip


def test_all_openai_voice_names_are_accepted() -> None:
    names = "alloy ash ballad cedar coral echo fable marin nova onyx sage shimmer verse".split()
    for name in names:
        assert _params({"model": "tts-1", "input": "x", "voice": name}).voice in ENGLISH_VOICES


def test_model_voices_pass_through_and_object_form() -> None:
    assert _params({"model": "m", "input": "x", "voice": "leo"}).voice == "leo"
    assert _params({"model": "m", "input": "x", "voice": "Leo"}).voice == "Leo"  # as the worker
    assert _params({"model": "m", "input": "x", "voice": {"id": "zoe"}}).voice == "zoe"


def test_a_voice_the_server_does_not_have_is_the_workers_400() -> None:
    with pytest.raises(APIError) as e:
        _params({"model": "m", "input": "x", "voice": "pierre"})
    assert (e.value.status, e.value.code, e.value.param) == (400, "bad_request", "voice")
    assert e.value.message == (
        "unknown voice 'pierre'; voices: tara, leah, jess, leo, dan, mia, zac, zoe "
        "(and the custom voices listed by GET /v1/audio/voices)"
    )
    # Other voices (custom, LoRA) are the catalog's lookups; an alias's target is checked too.
    extra = VoiceCatalog({"alloy": "ava"}, ["tara"], "tara", is_custom=lambda v: v == "ava")
    assert extra.resolve("ALLOY") == "ava" and extra.resolve("Ava") == "Ava"
    with pytest.raises(APIError):
        VoiceCatalog({"alloy": "pierre"}, ["tara"], "tara").resolve("alloy")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "voice": "tara"}, "model"),
        ({"model": "m", "voice": "tara"}, "input"),
        ({"model": "m", "input": "x"}, "voice"),
        ({"model": "m", "input": "  ", "voice": "tara"}, "input"),
        ({"model": "m", "input": "x" * 101, "voice": "tara"}, "input"),
        ({"model": "m", "input": "x", "voice": "ta ra: hi"}, "voice"),
        (
            {"model": "m", "input": "x", "voice": "tara", "response_format": "ogg"},
            "response_format",
        ),
        ({"model": "m", "input": "x", "voice": "tara", "speed": 4.5}, "speed"),
        ({"model": "m", "input": "x", "voice": "tara", "stream_format": "chunks"}, "stream_format"),
        ({"model": "m", "input": "x", "voice": "tara", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "input": "x", "voice": "tara", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "input": "x", "voice": "tara", "max_tokens": 4097}, "max_tokens"),
        ({"model": "m", "input": "x", "voice": "tara", "top_p": 0}, "top_p"),
        ({"model": "m", "input": "x", "voice": "tara", "temperature": 2.5}, "temperature"),
        (
            {"model": "m", "input": "x", "voice": "tara", "repetition_penalty": 3},
            "repetition_penalty",
        ),
        ({"model": "m", "input": "x", "voice": "tara", "colour": "blue"}, "colour"),
        ({"model": "", "input": "x", "voice": "tara"}, "model"),
    ],
)
def test_bad_requests_are_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        _params(body)
    assert e.value.status == 400
    assert e.value.param == param
    err = json.loads(e.value.to_json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)
speech_like = st.fixed_dictionaries(
    {},
    optional={
        k: json_values | st.text() | st.integers()
        for k in ("model", "input", "voice", "response_format", "speed", "stream_format",
                  "max_tokens", "seed", "temperature", "top_p", "repetition_penalty")
    },
)  # fmt: skip
bodies = (
    st.binary(max_size=300)
    | json_values.map(lambda v: json.dumps(v).encode())
    | speech_like.map(lambda v: json.dumps(v).encode())
)


@settings(max_examples=150, deadline=None)
@given(bodies)
def test_any_body_is_accepted_or_a_400(body: bytes) -> None:
    try:
        decode_and_validate = speech_params(decode_speech_request(body), VOICES, LIMITS, 100)
    except APIError as e:
        assert e.status == 400
    else:
        assert decode_and_validate.text


# -- admission -------------------------------------------------------------------------------
async def test_admission_queues_in_order_then_refuses() -> None:
    adm = Admission(
        max_active=1, max_queued=1, queue_timeout_s=5, retry_after_s=2, gate=lambda: None
    )
    await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    assert adm.queued == 1
    with pytest.raises(APIError) as e:
        await adm.acquire()
    assert e.value.status == 429 and e.value.headers() == {
        "Retry-After": "2",
        "current-concurrent-requests": "1",
        "maximum-concurrent-requests": "1",
    }
    adm.release()  # hands the slot to the waiter
    await waiter
    assert adm.active == 1 and adm.queued == 0


async def test_admission_queue_timeout_and_cancel_do_not_leak_slots() -> None:
    adm = Admission(
        max_active=1, max_queued=4, queue_timeout_s=0.05, retry_after_s=1, gate=lambda: None
    )
    await adm.acquire()
    with pytest.raises(APIError) as e:
        await adm.acquire()
    assert e.value.code == "queue_timeout"
    adm2 = Admission(
        max_active=1, max_queued=4, queue_timeout_s=5, retry_after_s=1, gate=lambda: None
    )
    await adm2.acquire()
    t = asyncio.create_task(adm2.acquire())
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    adm2.release()
    assert adm2.active == 0 and adm2.queued == 0


async def test_admission_gate_refuses_with_its_error() -> None:
    closed = APIError(503, "draining", "bye", retry_after_s=1)
    adm = Admission(
        max_active=4, max_queued=4, queue_timeout_s=1, retry_after_s=1, gate=lambda: closed
    )
    with pytest.raises(APIError) as e:
        await adm.acquire()
    assert e.value is closed and adm.active == 0


# -- stream registry -------------------------------------------------------------------------
class _Leaves:
    """What the registry tells its ``on_leave`` (in the gateway, ``Upstream.stream_left``,
    which cancels the worker streams that left early: tests/gateway/test_upstream.py)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str | None]] = []

    def __call__(self, stream: PcmStream, reason: str | None) -> None:
        self.calls.append((stream.stream_id, reason))

    @property
    def early(self) -> list[tuple[int, str | None]]:
        """The streams that left before their worker stream ended, and why."""
        return [c for c in self.calls if c[1] is not None]


def _registry(
    max_bytes: int = 1 << 20, retry_after_s: int | None = None
) -> tuple[StreamRegistry, _Leaves, GatewayMetrics]:
    left = _Leaves()
    m = GatewayMetrics(CollectorRegistry())
    reg = StreamRegistry(3, left, m, max_buffered_bytes=max_bytes, retry_after_s=retry_after_s)
    return reg, left, m


def _pcm(sid: int, seq: int, n: int = 8) -> Record:
    return Record(RecordKind.PCM, sid, seq, memoryview(bytes(range(seq, seq + n))))


def _end(sid: int, seq: int) -> Record:
    return Record(
        RecordKind.END, sid, seq, memoryview(record_encoder.encode(StreamEnd("stop", seq)))
    )


async def test_registry_routes_in_order_and_ends() -> None:
    reg, left, _ = _registry()
    a, b = reg.open(0.0), reg.open(0.0)
    assert gateway_of(a.stream_id) == 3 and a.stream_id != b.stream_id
    reg.dispatch([_pcm(a.stream_id, 0), _pcm(b.stream_id, 0), _pcm(a.stream_id, 1)], 1.0)
    assert [bytes(c) for c in await a.next_chunks()] == [bytes(range(0, 8)), bytes(range(1, 9))]
    reg.dispatch([_end(a.stream_id, 2)], 2.0)
    assert await a.next_chunks() == []
    assert a.end is not None and len(reg) == 1
    reg.release(a, "client_disconnected")  # already left, with its END
    reg.release(b, "client_disconnected")
    reg.release(b, "client_disconnected")  # a stream leaves once
    assert left.calls == [(a.stream_id, None), (b.stream_id, "client_disconnected")]


def _error(sid: int, err: StreamError) -> Record:
    return Record(RecordKind.ERROR, sid, 0, memoryview(record_encoder.encode(err)))


async def test_registry_says_when_to_retry_a_stream_lost_to_a_restart() -> None:
    reg, _, _ = _registry(retry_after_s=3)
    a, b, c = reg.open(0.0), reg.open(0.0), reg.open(0.0)
    # From a worker's ERROR record (the codec or llm worker noticed the restart) ...
    reg.dispatch([_error(a.stream_id, StreamError("worker_restarted", "died; retry", 503))], 0.0)
    reg.dispatch([_error(b.stream_id, StreamError("bad_request", "no", 400))], 0.0)
    # ... and from the gateway's own view of the cluster.
    reg.fail(c, StreamError("worker_restarted", "gone", 503), discard_pending=True)
    got = []
    for s in (a, b, c):
        with pytest.raises(StreamFailed) as e:
            await s.next_chunks()
        got.append((e.value.error.code, APIError.from_stream_error(e.value.error).headers()))
    assert got == [
        ("worker_restarted", {"Retry-After": "3"}),
        ("bad_request", {}),
        ("worker_restarted", {"Retry-After": "3"}),
    ]


async def test_registry_fails_a_stream_on_a_sequence_gap_only() -> None:
    reg, left, m = _registry()
    a, b = reg.open(0.0), reg.open(0.0)
    reg.dispatch([_pcm(a.stream_id, 0), _pcm(a.stream_id, 2), _pcm(b.stream_id, 0)], 0.0)
    assert len(await a.next_chunks()) == 1  # the audio before the gap is delivered
    with pytest.raises(StreamFailed) as e:
        await a.next_chunks()
    assert e.value.error.code == "pcm_sequence_error"
    assert left.early == [(a.stream_id, "pcm_sequence_error")]
    assert len(await b.next_chunks()) == 1 and not b.done
    assert m.registry.get_sample_value("orpheus_gateway_pcm_sequence_errors_total") == 1
    # Later records of the failed stream are dropped and counted.
    reg.dispatch([_pcm(a.stream_id, 3)], 0.0)
    assert m.registry.get_sample_value("orpheus_gateway_orphan_records_total") == 1


async def test_registry_error_record_and_garbage_payloads() -> None:
    reg, left, _ = _registry()
    a, b, c = reg.open(0.0), reg.open(0.0), reg.open(0.0)
    err = msgspec.msgpack.encode(StreamError("bad_request", "unknown voice 'x'", 400))
    reg.dispatch(
        [
            Record(RecordKind.ERROR, a.stream_id, 0, memoryview(err)),
            Record(RecordKind.END, b.stream_id, 0, memoryview(b"\xff\x00garbage")),
            Record(RecordKind.PCM, c.stream_id, 0, memoryview(b"odd")),
        ],
        0.0,
    )
    with pytest.raises(StreamFailed) as e:
        await a.next_chunks()
    assert (e.value.error.status, e.value.error.code) == (400, "bad_request")
    for s in (b, c):
        with pytest.raises(StreamFailed) as e:
            await s.next_chunks()
        assert e.value.error.code == "bad_record"
    assert sorted(left.early) == sorted([(b.stream_id, "bad_record"), (c.stream_id, "bad_record")])
    assert (a.stream_id, None) in left.calls, "an ERROR record ends the worker stream: no cancel"


async def test_registry_drops_a_slow_client_and_tears_it_down() -> None:
    reg, left, m = _registry(max_bytes=20)
    a = reg.open(0.0)
    aborted: list[bool] = []
    a.on_abort = lambda: aborted.append(True)
    reg.dispatch([_pcm(a.stream_id, i) for i in range(3)], 0.0)  # 24 bytes > 20
    with pytest.raises(StreamFailed) as e:
        await a.next_chunks()
    assert e.value.error.code == "slow_client" and aborted == [True]
    assert left.early == [(a.stream_id, "slow_client")]
    assert m.registry.get_sample_value("orpheus_gateway_slow_client_drops_total") == 1


async def test_consumer_wakes_when_records_arrive() -> None:
    reg, _, _ = _registry()
    a = reg.open(0.0)
    task = asyncio.create_task(a.next_chunks())
    await asyncio.sleep(0.01)
    assert not task.done()
    reg.dispatch([_pcm(a.stream_id, 0)], 0.0)
    assert len(await asyncio.wait_for(task, 1)) == 1


def test_cancel_messages_decode() -> None:
    from shm.messages import control_encoder

    assert llm_control_decoder.decode(control_encoder.encode(LlmCancel(5, "x"))) == LlmCancel(
        5, "x"
    )


# -- encoders --------------------------------------------------------------------------------
def _tone(n: int) -> np.ndarray:
    return (np.sin(np.arange(n) * 2 * np.pi * 220 / 24000) * 9000).astype("<i2")


def _decode_samples(data: bytes, fmt: str) -> int:
    if fmt == "pcm":
        return len(data) // 2
    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(audio=0))
    rate = frames[0].sample_rate
    return sum(f.samples for f in frames) * 24000 // rate


# Lossy codecs add priming/padding: mp3 up to ~2 frames of 576 plus the encoder delay,
# aac one 1024 priming frame plus padding to a frame; Ogg Opus trims its pre-skip.
TOLERANCE = {"pcm": 0, "wav": 0, "flac": 0, "opus": 480, "mp3": 2400, "aac": 2048}


@pytest.mark.parametrize("fmt", ENCODER_FORMATS)
def test_encoders_stream_and_decode_to_the_right_length(fmt: str) -> None:
    pcm = _tone(2048 * 12)
    enc = make_output(OutputFormat(fmt))
    out = [enc.encode(pcm[i : i + 2048].tobytes()) for i in range(0, len(pcm), 2048)]
    out.append(enc.finish())
    enc.close()
    assert sum(len(o) for o in out[:4]) > 0, "the first chunks must produce bytes (streaming)"
    n = _decode_samples(b"".join(out), fmt)
    assert n >= len(pcm) - (480 if fmt == "opus" else 0)
    assert abs(n - len(pcm)) <= TOLERANCE[fmt], (fmt, n, len(pcm))


@pytest.mark.parametrize(
    ("fmt", "speed"), [("pcm", 2.0), ("wav", 0.5), ("mp3", 1.5), ("pcm", 0.25)]
)
def test_speed_time_stretches(fmt: str, speed: float) -> None:
    pcm = _tone(2048 * 24)
    enc = make_output(OutputFormat(fmt), speed)
    out = b"".join(
        [*(enc.encode(pcm[i : i + 2048].tobytes()) for i in range(0, len(pcm), 2048)), enc.finish()]
    )
    n = _decode_samples(out, fmt)
    assert abs(n - len(pcm) / speed) < 0.02 * len(pcm) / speed + 2400


def test_tempo_factors_stay_in_the_filter_range() -> None:
    for speed in (0.25, 0.3, 0.5, 1.7, 4.0):
        f = tempo_factors(speed)
        assert all(0.5 <= x <= 100 for x in f)
        assert abs(np.prod(f) - speed) < 1e-9


def test_wav_header_uses_the_max_size_convention() -> None:
    h = wav_header()
    assert len(h) == 44 and h[:4] == b"RIFF" and h[8:16] == b"WAVEfmt "
    assert h[4:8] == b"\xff\xff\xff\xff" and h[40:44] == b"\xff\xff\xff\xff"


# -- SSE and ZeroMQ framing ------------------------------------------------------------------
def test_sse_events_are_openai_shaped() -> None:
    ev = delta_event(b"\x01\x02")
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    body = json.loads(ev[6:])
    assert body == {"type": "speech.audio.delta", "audio": base64.b64encode(b"\x01\x02").decode()}
    done = json.loads(done_event(70)[6:])
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] == 70


def test_zmq_endpoint_per_gateway_process() -> None:
    assert endpoint_for("tcp://127.0.0.1:8001", 0) == "tcp://127.0.0.1:8001"
    assert endpoint_for("tcp://127.0.0.1:8001", 2) == "tcp://127.0.0.1:8003"
    assert endpoint_for("ipc:///tmp/gw", 1) == "ipc:///tmp/gw-1"
