"""OpenTelemetry tracing's set-up (common/tracing.py) and its context as it crosses the
processes: the messages that carry it, the llm service's spans and START record, the codec
service's spans continuing them. Spans go to the SDK's in-memory exporter; the end-to-end test
with a real OTLP exporter and three processes is tests/e2e/test_e2e_tracing.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from llm_fakes import FakeEngine, FakePrompts, MemorySink, audio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from codec_worker.decoder import WindowDecoder
from codec_worker.engine import DecodeEngine
from codec_worker.output import CollectingSink
from codec_worker.service import CodecService
from codec_worker.snac_model import SNAC_24KHZ_SMALL, fuse_weight_norm
from common.config import ServeConfig
from common.config.codec import CodecConfig
from common.config.llm import LLMConfig
from common.tracing import (
    Tracing,
    TracingConfigError,
    setup_tracing,
    traces_protocol,
    tracing_enabled,
)
from llm_worker.model_info import ModelInfo
from llm_worker.service import LLMService
from llm_worker.vllm_ext import tokens as T
from orchestrator.failures import classify, preflight
from orpheus_wire.zeromq import Speak, client_decoder, encoder
from shm.messages import LlmCancel, LlmSubmit, control_encoder, llm_control_decoder
from shm.records import (
    FRAME_CODES,
    RecordKind,
    StreamEnd,
    StreamStart,
    make_stream_id,
    record_encoder,
    start_decoder,
)
from shm.ring import Record
from testkit.tiny_model import random_snac

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
INFO = ModelInfo(voices=("tara",), emotion_tags=(), source="test", zero_shot=False)


def memory_tracing(role: str = "llm") -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, role), exporter


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


# -- on or off ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "env", "on"),
    [
        ("", {}, False),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
        ("http://c:4318/v1/traces", {}, True),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "True"}, False),
        ("http://c:4318/v1/traces", {"OTEL_SDK_DISABLED": "true"}, False),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "false"}, True),
        ("", {"OTEL_SERVICE_NAME": "tts", "OTEL_TRACES_SAMPLER": "always_on"}, False),
    ],
)
def test_tracing_is_on_only_when_an_endpoint_is_given_and_the_sdk_not_disabled(
    configured: str, env: dict[str, str], on: bool
) -> None:
    assert tracing_enabled(configured, env) is on
    if not on:
        assert setup_tracing("gateway", configured, env) is None


def test_the_protocol_is_the_standard_variables_with_http_by_default() -> None:
    assert traces_protocol({}) == "http/protobuf"
    assert traces_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    both = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    }
    assert traces_protocol(both) == "http/protobuf"
    with pytest.raises(TracingConfigError, match="http/json"):
        traces_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_a_bad_protocol_is_a_permanent_failure_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked before any worker starts (preflight), and classified if a worker meets it."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    failure = preflight(ServeConfig(), probe_hub=False)
    assert failure is not None and "http/json" in failure.line()
    with pytest.raises(TracingConfigError) as e:
        setup_tracing("codec")
    failure = classify("codec", e.value, ServeConfig())
    assert failure is not None and "invalid tracing settings" in failure.line()


def test_off_imports_nothing_of_opentelemetry() -> None:
    """Tracing off costs nothing: the gateway and the codec worker (whose hot paths carry the
    hooks) and the set-up module load no OpenTelemetry module at all."""
    code = (
        "import sys, os\n"
        "for v in list(os.environ):\n"
        "    if v.startswith('OTEL_'): del os.environ[v]\n"
        "import gateway.main, gateway.app, codec_worker.main, common.tracing\n"
        "assert common.tracing.setup_tracing('gateway') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_the_process_resource_names_the_service_its_pid_and_role() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
        "ORPHEUS_SERVE_ROLE": "llm-1",
    }
    tracing = setup_tracing("llm", "", env)
    assert tracing is not None
    try:
        attrs = tracing.provider.resource.attributes
        assert attrs["service.name"] == "orpheus-serve"
        assert attrs["orpheus.role"] == "llm"
        assert attrs["orpheus.process"] == "llm-1"
        assert attrs["process.pid"] > 0
    finally:
        tracing.shutdown()
    with pytest.raises(ValueError, match="unknown role"):
        setup_tracing("orchestrator", "http://127.0.0.1:9/v1/traces", {})


# -- context ---------------------------------------------------------------------------------


def test_a_clients_traceparent_is_continued_and_a_bad_one_starts_a_trace() -> None:
    tracing, exporter = memory_tracing()
    span = tracing.start("tts.request", TRACEPARENT, server=True)
    child = tracing.start("gateway.admission", parent=span)
    child.end()
    sent = tracing.traceparent(span)
    span.end()
    spans = by_name(exporter)
    new = tracing.start("tts.request", "00-not-a-trace-01")
    new.end()
    ctx = span.get_span_context()
    assert f"{ctx.trace_id:032x}" == CLIENT_TRACE
    assert spans["tts.request"].parent.span_id == int(CLIENT_SPAN, 16)
    assert spans["tts.request"].parent.is_remote
    assert spans["gateway.admission"].parent.span_id == ctx.span_id
    assert sent == f"00-{CLIENT_TRACE}-{ctx.span_id:016x}-01"
    assert f"{new.get_span_context().trace_id:032x}" != CLIENT_TRACE


def test_the_context_travels_in_the_requests_own_messages() -> None:
    """LlmSubmit and Speak carry it; without it their bytes are those of before (omitted from
    LlmSubmit; Speak's older clients still decode: tests/gateway/frontends/zeromq/test_orpheus_wire.py)."""
    msg = LlmSubmit(1, "Hi.", "tara", traceparent=TRACEPARENT)
    assert llm_control_decoder.decode(control_encoder.encode(msg)) == msg
    assert b"traceparent" not in control_encoder.encode(LlmSubmit(1, "Hi.", "tara"))
    speak = Speak(request_id=1, input="Hi.", traceparent=TRACEPARENT)
    assert client_decoder.decode(encoder.encode(speak)) == speak
    start = StreamStart(TRACEPARENT, "tara")
    assert start_decoder.decode(record_encoder.encode(start)) == start


# -- the llm service -------------------------------------------------------------------------


def make_llm(tracing: Tracing | None) -> tuple[LLMService, FakeEngine, MemorySink]:
    config = LLMConfig(model="unused", max_model_len=2048, max_chars_per_segment=40)
    engine, sink = FakeEngine(None), MemorySink()
    svc = LLMService(config, engine, sink, FakePrompts(), INFO, tracing=tracing)
    return svc, engine, sink


def frames(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 4096, (n, FRAME_CODES)).astype(np.int16)


async def test_a_traced_stream_starts_the_code_ring_with_its_context() -> None:
    tracing, exporter = memory_tracing()
    svc, eng, sink = make_llm(tracing)
    await svc.handle(LlmSubmit(1, "Hello there.", "tara", traceparent=TRACEPARENT))
    await svc.handle(LlmSubmit(2, "Hello there.", "tara"))  # untraced: no START, no span
    for sid in (1, 2):
        eng.emit(eng.current(sid).request_id, audio(frames(3)))
    await svc.pump()
    kinds = [(r.kind, r.stream_id) for r in sink.records]
    assert kinds[0] == (RecordKind.START, 1), "START comes before the stream's first CODES"
    assert (RecordKind.START, 2) not in kinds
    assert {(RecordKind.CODES, 1), (RecordKind.CODES, 2)} <= set(kinds)
    start = start_decoder.decode(sink.records[0].payload)
    assert start.voice == "tara"
    prefill = by_name(exporter)["llm.prefill"]  # ended by the first token
    for sid in (1, 2):
        eng.emit(eng.current(sid).request_id, [*audio(frames(2)), T.END_OF_SPEECH], "stop")
    await svc.pump()
    spans = by_name(exporter)
    stream = spans["llm.stream"]
    assert f"{stream.context.trace_id:032x}" == CLIENT_TRACE
    assert stream.parent.span_id == int(CLIENT_SPAN, 16)
    assert prefill.parent.span_id == stream.context.span_id
    assert start.traceparent == f"00-{CLIENT_TRACE}-{stream.context.span_id:016x}-01"
    assert stream.attributes["orpheus.outcome"] == "stop"
    assert stream.attributes["orpheus.tokens"] == 5 * FRAME_CODES
    assert stream.attributes["orpheus.frames"] == 5
    assert [e.name for e in stream.events] == ["segment"]
    assert prefill.end_time <= stream.end_time
    assert set(spans) == {"llm.stream", "llm.prefill"}


async def test_a_cancelled_stream_ends_its_spans_with_the_cancellation() -> None:
    tracing, exporter = memory_tracing()
    svc, _, _ = make_llm(tracing)
    await svc.handle(LlmSubmit(1, "Hello there.", "tara", traceparent=TRACEPARENT))
    await svc.handle(LlmCancel(1))
    spans = by_name(exporter)
    assert spans["llm.stream"].attributes["orpheus.outcome"] == "cancelled"
    assert [e.name for e in spans["llm.stream"].events] == ["segment", "cancelled"]
    assert "llm.prefill" in spans, "no token ever came: the prefill span still ends"


async def test_tracing_off_the_service_writes_no_start_record() -> None:
    svc, eng, sink = make_llm(None)
    await svc.handle(LlmSubmit(1, "Hello there.", "tara", traceparent=TRACEPARENT))
    eng.emit(eng.current(1).request_id, [*audio(frames(2)), T.END_OF_SPEECH], "stop")
    await svc.pump()
    assert [r.kind for r in sink.records] == [RecordKind.CODES, RecordKind.END]


# -- the codec service -----------------------------------------------------------------------


def make_codec(tracing: Tracing | None) -> tuple[CodecService, CollectingSink]:
    cfg = CodecConfig()
    decoder = WindowDecoder(fuse_weight_norm(random_snac(0, SNAC_24KHZ_SMALL))).eval()
    engine = DecodeEngine.for_config(decoder, cfg, torch.device("cpu"))
    sink = CollectingSink()
    return CodecService(cfg, engine, sink, 1, tracing=tracing), sink


def test_the_codec_continues_the_trace_from_the_start_record() -> None:
    torch.set_num_threads(1)
    tracing, exporter = memory_tracing("codec")
    svc, sink = make_codec(tracing)
    llm_span = tracing.start("llm.stream", TRACEPARENT)
    sid, other = make_stream_id(0, 1), make_stream_id(0, 2)
    start = record_encoder.encode(StreamStart(tracing.traceparent(llm_span), "tara"))
    codes = frames(12).astype("<i2").tobytes()
    end = record_encoder.encode(StreamEnd("stop", 12))
    records = [
        Record(RecordKind.START, sid, 0, memoryview(start)),
        *(Record(RecordKind.CODES, s, 0, memoryview(codes)) for s in (sid, other)),
        *(Record(RecordKind.END, s, 12, memoryview(end)) for s in (sid, other)),
    ]
    svc.ingest(records)
    while svc.pump() or svc.streams:
        pass
    llm_span.end()
    spans = by_name(exporter)
    stream, first = spans["codec.stream"], spans["codec.first_window"]
    assert stream.parent.span_id == llm_span.get_span_context().span_id
    assert first.parent.span_id == stream.context.span_id
    assert f"{stream.context.trace_id:032x}" == CLIENT_TRACE
    batches = [e for e in stream.events if e.name == "decode_batch"]
    assert batches, "every decode batch is an event, not a span"
    assert sum(e.attributes["orpheus.frames"] for e in batches) == 12
    assert first.end_time <= batches[1].timestamp if len(batches) > 1 else True
    assert stream.attributes["orpheus.outcome"] == "stop"
    assert stream.attributes["orpheus.frames"] == 12
    assert set(spans) == {"codec.stream", "codec.first_window", "llm.stream"}, "one stream traced"
    assert svc.traces == {}
    pcm = [r for r in sink.records if r[1] == RecordKind.PCM]
    assert {r[2] for r in pcm} == {sid, other}, "both streams' audio, traced or not"


def test_tracing_off_the_codec_ignores_start_records() -> None:
    svc, sink = make_codec(None)
    start = record_encoder.encode(StreamStart(TRACEPARENT))
    svc.ingest([Record(RecordKind.START, make_stream_id(0, 1), 0, memoryview(start))])
    assert svc.traces == {} and svc.streams == {} and sink.records == []


def test_an_undecodable_start_record_is_ignored() -> None:
    tracing, _ = memory_tracing("codec")
    svc, _ = make_codec(tracing)
    svc.ingest([Record(RecordKind.START, make_stream_id(0, 1), 0, memoryview(b"\xc1"))])
    assert svc.traces == {}
