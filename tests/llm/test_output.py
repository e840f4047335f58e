"""The llm service's RingSink on a real code ring: staging, one publish, the full-ring wait."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
from llm_fakes import FakeEngine, FakePrompts, Rec, audio, contiguous, received
from prometheus_client import REGISTRY

from common.config.llm import LLMConfig
from llm_worker.model_info import ModelInfo
from llm_worker.output import RingSink
from llm_worker.service import LLMService
from llm_worker.vllm_ext import tokens as T
from shm.layout import InstanceLayout
from shm.messages import LlmSubmit
from shm.records import CODE_DTYPE, FRAME_CODES, RecordKind
from shm.ring import RingReader, RingWriter, create_ring

RING_BYTES = 4096


@pytest.fixture
def ring(layout: InstanceLayout) -> Iterator[tuple[RingWriter, RingReader]]:
    create_ring(layout.engine_code_ring(0), RING_BYTES)
    reader = RingReader(layout.engine_code_ring(0))
    writer = RingWriter(layout.engine_code_ring(0))
    yield writer, reader
    writer.close()
    reader.close()


def drain(reader: RingReader) -> list[Rec]:
    out = [Rec(r.kind, r.stream_id, r.seq, bytes(r.payload)) for r in reader.poll()]
    reader.release()
    return out


def waits() -> float:
    return REGISTRY.get_sample_value("orpheus_llm_ring_wait_seconds_count", {"engine": "0"}) or 0.0


def test_staged_records_appear_together_at_publish(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    sink = RingSink(writer, timeout_s=1.0)
    assert sink.max_payload == writer.max_payload
    frames = np.arange(14, dtype=CODE_DTYPE).reshape(2, 7)
    assert sink.try_put(RecordKind.CODES, 1, 0, frames)
    assert sink.try_put(RecordKind.CODES, 2, 0, frames[:1])
    assert drain(reader) == []
    sink.publish()
    assert drain(reader) == [
        Rec(RecordKind.CODES, 1, 0, frames.tobytes()),
        Rec(RecordKind.CODES, 2, 0, frames[:1].tobytes()),
    ]


async def test_a_full_ring_waits_then_times_out_without_staging(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    sink = RingSink(writer, timeout_s=0.2)
    payload = bytes(1000)
    n = 0
    while sink.try_put(RecordKind.CODES, 1, n, payload):
        n += 1
    before = waits()
    assert not await sink.wait_put(RecordKind.CODES, 1, n, payload)
    assert waits() == before + 1
    got = drain(reader)  # what was staged was published before the wait
    assert [r.seq for r in got] == list(range(n))
    sink.publish()
    assert drain(reader) == [], "the refused record was not staged"


async def test_a_full_ring_waits_for_the_consumer(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    sink = RingSink(writer, timeout_s=5.0)
    payload = bytes(1000)
    n = 0
    while sink.try_put(RecordKind.CODES, 1, n, payload):
        n += 1
    seen: list[Rec] = []
    asyncio.get_running_loop().call_later(0.05, lambda: seen.extend(drain(reader)))
    assert await sink.wait_put(RecordKind.CODES, 1, n, payload)
    sink.publish()
    seen.extend(drain(reader))
    assert [r.seq for r in seen] == list(range(n + 1))


async def test_the_service_on_a_real_ring(ring: tuple[RingWriter, RingReader]) -> None:
    """Two streams through the service, its RingSink and the ring, read back in order."""
    writer, reader = ring
    info = ModelInfo(voices=("tara",), emotion_tags=(), source="test")
    engine = FakeEngine()
    config = LLMConfig(model="unused", max_model_len=2048)
    svc = LLMService(config, engine, RingSink(writer, 1.0), FakePrompts(), info)
    rng = np.random.default_rng(0)
    f = {sid: rng.integers(0, 4096, (3, FRAME_CODES)).astype(np.int16) for sid in (1, 2)}
    for sid in f:
        await svc.handle(LlmSubmit(sid, "Hello.", "tara"))
        engine.emit(f"{sid:x}-0", audio(f[sid])[:10])
    await svc.pump()
    for sid in f:
        engine.emit(f"{sid:x}-0", [*audio(f[sid])[10:], T.END_OF_SPEECH], "stop")
    await svc.pump()
    got = received(drain(reader))
    for sid, frames in f.items():
        assert contiguous(got[sid]) and np.array_equal(got[sid].frames, frames)
