"""The llm service as a state machine: a fake engine in, an in-memory sink out (no vLLM engine,
no ring). Records (kinds, seq, frames, END reasons, ERROR codes), their order, segments,
cancellation, bad requests, engine failures, backpressure, voices, sampling hooks, metrics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llm_fakes import (
    FakeEngine,
    FakePrompts,
    MemorySink,
    Received,
    audio,
    contiguous,
    received,
    spoken,
)
from prometheus_client import REGISTRY
from vllm.v1.engine.exceptions import EngineDeadError

from common.config.llm import LLMConfig, VoiceSampling
from llm_worker import metrics as M
from llm_worker.model_info import ModelInfo
from llm_worker.requests import BadRequest, length_cap
from llm_worker.service import LLMService
from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.sampling.hooks import SamplingHooks
from llm_worker.vllm_ext.token_space import TokenSpace
from shm.messages import LlmAppendText, LlmCancel, LlmSubmit, SamplingOverrides
from shm.records import FRAME_CODES, RecordKind

INFO = ModelInfo(voices=("tara", "leo"), emotion_tags=("laugh",), source="test", zero_shot=True)
EOS = T.END_OF_SPEECH
PIECES = (
    "Alpha beta gamma delta epsilon one.",
    "Zeta eta theta iota kappa lambda two.",
    "Mu nu xi omicron pi rho sigma three.",
)
"""Sentences of at most 40 characters, no two of which fit one 40-character piece."""


def make(
    sink: MemorySink | None = None,
    prompts: Any = None,
    space: TokenSpace | None = None,
    **fields: Any,
) -> tuple[LLMService, FakeEngine, MemorySink]:
    fields = {"model": "unused", "max_model_len": 2048, "max_chars_per_segment": 40, **fields}
    config = LLMConfig(**fields)
    engine = FakeEngine(space)
    sink = sink if sink is not None else MemorySink()
    svc = LLMService(config, engine, sink, prompts or FakePrompts(), INFO)
    return svc, engine, sink


def frames(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, (n, FRAME_CODES)).astype(np.int16)


def metric(name: str, **labels: str) -> float:
    """A sample of the worker's metrics (engine 0's: every metric carries the label)."""
    return REGISTRY.get_sample_value(name, {"engine": M.ENGINE, **labels}) or 0.0


class Metrics:
    """Deltas of the worker's metrics across a test."""

    NAMES: ClassVar[dict[str, tuple[str, dict[str, str]]]] = {
        "frames": ("orpheus_llm_frames_written_total", {}),
        "segments": ("orpheus_llm_segments_total", {}),
        "active": ("orpheus_llm_active_streams", {}),
        "invalid": ("orpheus_llm_invalid_tokens_total", {}),
        "dropped_invalid": ("orpheus_llm_frames_dropped_total", {"reason": "invalid"}),
        "dropped_incomplete": ("orpheus_llm_frames_dropped_total", {"reason": "incomplete"}),
        "repetition_stops": ("orpheus_llm_repetition_stops_total", {}),
        "steps": ("orpheus_llm_step_publish_seconds_count", {}),
        "tokens": ("orpheus_llm_tokens_per_step_sum", {}),
    }
    OUTCOMES = ("stop", "length", "repetition", "cancelled", "error", "bad_request")

    def __init__(self) -> None:
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        out = {k: metric(n, **lb) for k, (n, lb) in self.NAMES.items()}
        for o in self.OUTCOMES:
            out[o] = metric("orpheus_llm_streams_total", outcome=o)
        return out

    def delta(self) -> dict[str, float]:
        now = self._read()
        return {k: now[k] - self._start[k] for k in now if now[k] != self._start[k]}


async def finish(svc: LLMService, eng: FakeEngine, sid: int, f: np.ndarray, reason: str) -> None:
    """The stream's current request speaks ``f`` in one step and ends with ``reason``."""
    rid = eng.current(sid).request_id
    eng.emit(rid, [*audio(f), *([EOS] if reason == "stop" else [])], reason)
    await svc.pump()


# -- steps, records and their order ---------------------------------------------------------


async def test_the_audio_head_engine_ids_are_converted_at_the_boundary() -> None:
    """With the audio output head the engine sees rotated ids: the prompt goes in rotated,
    the stop id is the engine's end-of-speech, and sampled ids come out as the same frames."""
    space = TokenSpace.audio(T.VOCAB_SIZE)
    svc, eng, sink = make(space=space)
    await svc.handle(LlmSubmit(1, "Hello there.", "tara"))
    req = eng.requests[0]
    back = np.asarray(req.prompt, dtype=np.int64)
    assert spoken(space.from_engine_(back).tolist()) == "tara: Hello there."
    assert req.prompt[-1] == space.start_of_speech == 1
    assert req.params.stop_token_ids == [space.end_of_speech] == [2]

    f = frames(3, 7)
    engine_ids = space.to_engine(audio(f))
    assert max(engine_ids) < space.width, "every audio id is a column of the audio head"
    eng.emit("1-0", [*engine_ids, space.end_of_speech], "stop")
    await svc.pump()
    got = received(sink.records)
    assert np.array_equal(got[1].frames, f)
    end = got[1].end
    assert end is not None and (end.reason, end.frames, end.tokens) == ("stop", 3, 21)


async def test_a_step_is_one_record_per_stream_in_one_publish_and_end_follows_codes() -> None:
    svc, eng, sink = make()
    m = Metrics()
    await svc.handle(LlmSubmit(1, "Hello there.", "tara"))
    await svc.handle(LlmSubmit(2, "Hi.", "Leo"))
    assert [(r.request_id, spoken(r.prompt)) for r in eng.requests] == [
        ("1-0", "tara: Hello there."),
        ("2-0", "leo: Hi."),
    ]
    params = eng.requests[0].params
    assert params.max_tokens == length_cap(LLMConfig(), len("Hello there."))
    assert params.min_tokens == 0
    assert params.stop_token_ids == [EOS] and params.seed is None
    assert svc.active_streams == 2 and m.delta()["active"] == 2

    a, b = frames(2, 1), frames(2, 2)
    eng.emit("1-0", audio(a))
    eng.emit("2-0", audio(b)[:10])  # one frame and 3 tokens of the next
    await svc.pump()
    assert sink.publishes == [2], "every stream's frames of a step: one head update"
    got = received(sink.records)
    assert got[1].seqs == [0] and np.array_equal(got[1].frames, a)
    assert got[2].seqs == [0] and np.array_equal(got[2].frames, b[:1])

    eng.emit("1-0", [EOS], "stop")
    eng.emit("2-0", [*audio(b)[10:], EOS], "stop")
    await svc.pump()
    assert sink.publishes == [2, 1, 2], "this step's CODES, then the endings it caused"
    got = received(sink.records)
    assert [r.kind for r in sink.records[-3:]] == [RecordKind.CODES, RecordKind.END, RecordKind.END]
    for sid, f in ((1, a), (2, b)):
        assert contiguous(got[sid]) and np.array_equal(got[sid].frames, f)
        end = got[sid].end
        assert end is not None and (end.reason, end.frames, end.tokens) == ("stop", 2, 14)
        assert end.invalid_tokens_prevented == 0
    assert svc.active_streams == 0
    d = m.delta()
    assert d == {"frames": 4, "segments": 2, "stop": 2, "steps": 2, "tokens": 28}


async def test_frames_of_one_step_split_into_records_that_fit_the_ring() -> None:
    svc, eng, sink = make(MemorySink(max_payload=2 * 7 * 2))  # two frames per record
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    f = frames(5)
    await finish(svc, eng, 1, f, "length")
    got = received(sink.records)[1]
    assert [(seq, len(x)) for seq, x in got.codes] == [(0, 2), (2, 2), (4, 1)]
    assert contiguous(got) and np.array_equal(got.frames, f)
    assert sink.publishes == [3, 1]


async def test_invalid_tokens_drop_their_frame_and_seq_counts_frames_written() -> None:
    svc, eng, sink = make()
    m = Metrics()
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    f = frames(3)
    tokens = audio(f)
    tokens[9] = 1000  # a text token in the second frame
    eng.emit("1-0", tokens[:12])
    await svc.pump()
    eng.emit("1-0", [*tokens[12:], EOS], "stop")
    await svc.pump()
    got = received(sink.records)[1]
    assert contiguous(got) and np.array_equal(got.frames, f[[0, 2]])
    assert got.end is not None and (got.end.frames, got.end.tokens) == (2, 21)
    d = m.delta()
    assert (d["invalid"], d["dropped_invalid"], d["frames"]) == (1, 1, 2)


async def test_a_length_cut_drops_the_incomplete_frame() -> None:
    svc, eng, sink = make()
    m = Metrics()
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    f = frames(2)
    eng.emit("1-0", audio(f)[:11], "length")
    await svc.pump()
    got = received(sink.records)[1]
    assert contiguous(got) and np.array_equal(got.frames, f[:1])
    assert got.end is not None and (got.end.reason, got.end.tokens) == ("length", 11)
    assert m.delta()["dropped_incomplete"] == 1


async def test_the_pump_runs_after_each_engine_step() -> None:
    svc, eng, sink = make()
    pump = asyncio.create_task(svc.run())
    try:
        await svc.handle(LlmSubmit(1, "Hello.", "tara"))
        eng.emit("1-0", [*audio(frames(1)), EOS], "stop")
        svc.on_step()  # the engine's step hook
        for _ in range(100):
            await asyncio.sleep(0)
            if sink.records:
                break
        got = received(sink.records)[1]
        assert contiguous(got) and got.end is not None and got.end.frames == 1
    finally:
        pump.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pump


# -- segments -------------------------------------------------------------------------------


async def test_long_text_is_segments_in_order_with_continuous_frames() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, " ".join(PIECES), "tara", SamplingOverrides(seed=5)))
    parts = [frames(2 + k, k) for k in range(3)]
    reasons = ["stop", "length", "stop"]
    for k, (f, reason) in enumerate(zip(parts, reasons, strict=True)):
        req = eng.current(1)
        assert req.request_id == f"1-{k}" and spoken(req.prompt) == f"tara: {PIECES[k]}"
        assert req.params.seed == 5 + k
        assert not any(r.kind == RecordKind.END for r in sink.records), "END only at the end"
        await finish(svc, eng, 1, f, reason)
    got = received(sink.records)[1]
    assert contiguous(got) and np.array_equal(got.frames, np.concatenate(parts))
    assert got.end is not None and got.end.reason == "length", "the worst segment ending"
    assert got.end.tokens == 7 * 9 and not eng.live


async def test_a_fixed_length_is_shared_among_segments_exactly() -> None:
    svc, eng, sink = make()
    text = "The first sentence is here. A second one follows it. And the third ends it all."
    await svc.handle(LlmSubmit(1, text, "tara", SamplingOverrides(max_tokens=7 * 12, seed=5)))
    budgets = []
    while eng.live:
        req = eng.current(1)
        p = req.params
        assert p.min_tokens == p.max_tokens, "a fixed length ignores end of speech"
        budgets.append(p.max_tokens)
        await finish(svc, eng, 1, frames(p.max_tokens // 7, len(budgets)), "length")
    assert budgets == [28, 21, 35]
    got = received(sink.records)[1]
    assert contiguous(got) and got.end is not None
    assert (got.end.reason, got.end.frames, got.end.tokens) == ("length", 12, 84)


async def test_a_piece_whose_share_of_a_fixed_length_is_zero_is_skipped() -> None:
    svc, eng, sink = make()
    text = "Short one. This second sentence is rather longer."
    await svc.handle(LlmSubmit(1, text, "tara", SamplingOverrides(max_tokens=7)))
    (req,) = eng.requests
    assert spoken(req.prompt) == "tara: This second sentence is rather longer."
    assert req.params.max_tokens == 7
    await finish(svc, eng, 1, frames(1), "length")
    got = received(sink.records)[1]
    assert contiguous(got) and got.end is not None and got.end.frames == 1


async def test_open_text_chains_segments_as_sentences_arrive() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, "First part of it. Sec", "tara", text_open=True))
    assert [spoken(r.prompt) for r in eng.requests] == ["tara: First part of it."]
    await svc.handle(LlmAppendText(1, "ond part. Third", final=False))
    assert len(eng.requests) == 1, "one segment at a time"
    parts = [frames(2, k) for k in range(3)]
    await finish(svc, eng, 1, parts[0], "stop")
    assert spoken(eng.requests[1].prompt) == "tara: Second part."
    await finish(svc, eng, 1, parts[1], "stop")
    assert len(eng.requests) == 2 and not eng.live
    assert received(sink.records)[1].end is None, "open text: the stream waits for more"
    await svc.handle(LlmAppendText(1, " piece.", final=True))
    assert spoken(eng.requests[2].prompt) == "tara: Third piece."
    await finish(svc, eng, 1, parts[2], "stop")
    got = received(sink.records)[1]
    assert contiguous(got) and np.array_equal(got.frames, np.concatenate(parts))
    assert got.end is not None and got.end.reason == "stop"
    n = len(sink.records)
    await svc.handle(LlmAppendText(1, "Too late.", final=True))
    await svc.pump()
    assert len(sink.records) == n and len(eng.requests) == 3


async def test_append_text_to_a_closed_text_is_ignored() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    await svc.handle(LlmAppendText(1, "More words.", final=True))
    assert len(eng.requests) == 1
    await finish(svc, eng, 1, frames(1), "stop")
    assert len(eng.requests) == 1 and received(sink.records)[1].end is not None


async def test_open_text_that_closes_empty_is_a_400() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, "", "tara", text_open=True))
    await svc.handle(LlmAppendText(1, "  ", final=True))
    await svc.pump()
    got = received(sink.records)[1]
    assert got.error is not None and (got.error.status, got.error.code) == (400, "empty_input")
    assert "empty text" in got.error.message and not eng.requests


async def test_the_repetition_guard_ends_a_looping_segment() -> None:
    svc, eng, sink = make(repetition_guard_frames=8)
    m = Metrics()
    await svc.handle(LlmSubmit(1, f"{PIECES[0]} {PIECES[1]}", "tara"))
    loop = np.tile(frames(1), (8, 1))
    eng.emit("1-0", audio(loop[:5]))
    await svc.pump()
    eng.emit("1-0", audio(loop[5:]))
    await svc.pump()
    assert eng.aborted == ["1-0"], "the looping request is aborted"
    assert spoken(eng.current(1).prompt) == f"tara: {PIECES[1]}", "the next piece goes on"
    await finish(svc, eng, 1, frames(2), "stop")
    got = received(sink.records)[1]
    assert contiguous(got) and got.end is not None
    assert (got.end.reason, got.end.frames) == ("repetition", 10)
    d = m.delta()
    assert (d["repetition_stops"], d["repetition"]) == (1, 1)


# -- cancellation ---------------------------------------------------------------------------


async def test_cancel_mid_segment_aborts_and_ends_the_stream() -> None:
    svc, eng, sink = make()
    m = Metrics()
    await svc.handle(LlmSubmit(1, "A long sentence to be cut short.", "tara"))
    f = frames(3)
    eng.emit("1-0", audio(f)[:17])  # two frames and three tokens
    await svc.pump()
    await svc.handle(LlmCancel(1, "client went away"))
    assert eng.aborted == ["1-0"]
    await svc.pump()
    got = received(sink.records)[1]
    assert contiguous(got) and np.array_equal(got.frames, f[:2])
    assert got.end is not None and (got.end.reason, got.end.frames, got.end.tokens) == (
        "cancelled",
        2,
        17,
    )
    n = len(sink.records)
    await svc.handle(LlmCancel(1))
    await svc.handle(LlmAppendText(1, "more", final=True))
    await svc.pump()
    assert len(sink.records) == n and eng.aborted == ["1-0"], "nothing follows END"
    d = m.delta()
    assert (d["cancelled"], d["dropped_incomplete"], d.get("active", 0)) == (1, 1, 0)


async def test_cancel_while_the_request_is_being_added() -> None:
    svc, eng, sink = make()
    eng.gate = asyncio.Event()
    submit = asyncio.create_task(svc.handle(LlmSubmit(1, "Hello.", "tara")))
    await asyncio.sleep(0)
    await svc.handle(LlmCancel(1))
    eng.gate.set()
    await submit
    assert eng.aborted == ["1-0"], "the request added after the cancel is aborted"
    await svc.pump()
    got = received(sink.records)[1]
    assert got.end is not None and (got.end.reason, got.end.frames, got.end_seq) == (
        "cancelled",
        0,
        0,
    )
    assert not got.codes and svc.active_streams == 0


async def test_cancel_between_segments_starts_no_more() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, " ".join(PIECES), "tara"))
    await finish(svc, eng, 1, frames(1), "stop")
    await svc.handle(LlmCancel(1))
    await svc.pump()
    assert eng.aborted == ["1-1"] and len(eng.requests) == 2
    got = received(sink.records)[1]
    assert contiguous(got) and got.end is not None and got.end.reason == "cancelled"


# -- bad requests and failures ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("submit", "fragment"),
    [
        (LlmSubmit(1, "Hello.", "nobody"), "unknown voice"),
        (LlmSubmit(1, "   ", "tara"), "empty text"),
        (LlmSubmit(1, "Hi.", "tara", SamplingOverrides(temperature=3.0)), "temperature"),
        (LlmSubmit(1, "Hi.", "tara", SamplingOverrides(max_tokens=3)), "max_tokens"),
        (
            LlmSubmit(1, "Hi.", "tara", SamplingOverrides(max_tokens=70), text_open=True),
            "text_open",
        ),
    ],
)
async def test_bad_requests_are_a_400_with_no_engine_work(submit: LlmSubmit, fragment: str) -> None:
    svc, eng, sink = make()
    m = Metrics()
    await svc.handle(submit)
    await svc.pump()
    assert not eng.requests and svc.active_streams == 0
    (rec,) = sink.records
    assert (rec.kind, rec.stream_id, rec.seq) == (RecordKind.ERROR, 1, 0)
    err = received(sink.records)[1].error
    # A blank text has the gateway's code for a blank input; the rest are bad_request.
    code = "empty_input" if fragment == "empty text" else "bad_request"
    assert err is not None and (err.status, err.code) == (400, code)
    assert fragment in err.message
    assert m.delta() == {"bad_request": 1}


async def test_a_prompt_too_long_for_the_model_is_a_400_with_no_engine_work() -> None:
    svc, eng, sink = make(max_model_len=40)
    await svc.handle(LlmSubmit(1, "This text makes a prompt of over forty ids.", "tara"))
    await svc.pump()
    got = received(sink.records)[1]
    assert (
        got.error is not None and got.error.status == 400 and "max_model_len" in got.error.message
    )
    assert not eng.requests and svc.active_streams == 0


async def test_a_duplicate_stream_id_is_ignored() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    await svc.handle(LlmSubmit(1, "Other.", "leo"))
    assert len(eng.requests) == 1 and svc.active_streams == 1
    await finish(svc, eng, 1, frames(1), "stop")
    assert contiguous(received(sink.records)[1])


@pytest.mark.parametrize(
    ("error", "status", "code", "message"),
    [
        (ValueError("too many tokens"), 400, "bad_request", "rejected by the engine: too many"),
        (RuntimeError("boom"), 500, "engine_error", "RuntimeError: boom"),
    ],
)
async def test_a_request_the_engine_refuses_fails_its_stream(
    error: Exception, status: int, code: str, message: str
) -> None:
    svc, eng, sink = make()
    eng.add_error = error
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    await svc.pump()
    got = received(sink.records)[1]
    assert got.error is not None and (got.error.status, got.error.code) == (status, code)
    assert got.error.message.startswith(message) and svc.active_streams == 0


async def test_a_broken_request_fails_its_stream_and_not_the_others() -> None:
    svc, eng, sink = make()
    for sid in (1, 2, 3):
        await svc.handle(LlmSubmit(sid, "Hello.", "tara"))
    f = frames(1)
    eng.fail("1-0", RuntimeError("bad output"))
    eng.emit("2-0", audio(f), "abort")
    eng.emit("3-0", audio(f))
    await svc.pump()
    got = received(sink.records)
    assert got[1].error is not None and got[1].error.code == "engine_error"
    assert got[1].error.status == 500 and got[1].error.message == "RuntimeError: bad output"
    assert got[2].error is not None and got[2].error.code == "engine_error"
    assert got[2].error.message == "generation ended with 'abort'"
    assert got[2].codes, "its frames of the step were written before the failure"
    assert sorted(eng.aborted) == ["1-0", "2-0"] and svc.active_streams == 1
    await finish(svc, eng, 3, f, "stop")
    got = received(sink.records)
    assert contiguous(got[3]) and len(got[3].frames) == 2


async def test_a_bug_while_handling_a_message_fails_that_stream_only() -> None:
    class Broken(FakePrompts):
        def build(self, voice: str, text: str) -> list[int]:
            if "boom" in text:
                raise RuntimeError("tokenizer broke")
            return super().build(voice, text)

    svc, eng, sink = make(prompts=Broken())
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    await svc.handle(LlmSubmit(2, "boom.", "tara"))
    await svc.pump()
    err = received(sink.records)[2].error
    assert err is not None and (err.status, err.code) == (500, "internal_error")
    assert err.message == "internal error: RuntimeError: tokenizer broke"
    assert svc.active_streams == 1
    await finish(svc, eng, 1, frames(1), "stop")
    assert contiguous(received(sink.records)[1])


async def test_a_dead_engine_stops_the_pump_and_shutdown_fails_every_stream() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    await svc.handle(LlmSubmit(2, "Hello.", "tara"))
    eng.emit("2-0", audio(frames(1)))
    eng.fail("1-0", EngineDeadError())
    with pytest.raises(EngineDeadError):
        await svc.pump()
    await svc.shutdown("worker_restarted", "the llm worker failed; retry")
    got = received(sink.records)
    for sid in (1, 2):
        err = got[sid].error
        assert err is not None and (err.status, err.code) == (503, "worker_restarted")
    assert svc.active_streams == 0 and not eng.aborted, "a dead engine is not asked to abort"
    eng.add_error = EngineDeadError()
    with pytest.raises(EngineDeadError):
        await svc.handle(LlmSubmit(3, "Hello.", "tara"))


async def test_shutdown_fails_the_streams_in_flight_with_503() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    eng.emit("1-0", audio(frames(2)))
    await svc.pump()
    await svc.shutdown()
    got = received(sink.records)[1]
    assert got.seqs == [0] and got.error is not None and got.error_seq == 2
    assert (got.error.status, got.error.code) == (503, "shutdown")
    assert got.error.message == "the worker stopped"


# -- backpressure -----------------------------------------------------------------------------


async def test_a_full_ring_fails_the_stream_being_written_and_spares_the_others() -> None:
    svc, eng, sink = make()
    for sid in (1, 2):
        await svc.handle(LlmSubmit(sid, "Hello.", "tara"))
    a, b = frames(2, 1), frames(2, 2)
    eng.emit("1-0", audio(a)[:7])
    eng.emit("2-0", audio(b)[:7])
    sink.full, sink.timeouts = True, 1  # the ring stays full past one timeout, then drains
    await svc.pump()
    assert sink.waits == [(RecordKind.CODES, 1, 0)]
    got = received(sink.records)
    assert not got[1].codes and got[1].error is not None
    assert (got[1].error.status, got[1].error.code) == (503, "backpressure")
    assert got[1].error.message == "the codec worker fell behind"
    assert eng.aborted == ["1-0"]
    assert got[2].seqs == [0] and np.array_equal(got[2].frames, b[:1])
    await finish(svc, eng, 2, b[1:], "stop")
    got = received(sink.records)
    assert contiguous(got[2]) and got[1].after_end == 0


async def test_an_end_waits_for_ring_space_and_is_never_dropped() -> None:
    svc, eng, sink = make()
    pump = asyncio.create_task(svc.run())
    try:
        await svc.handle(LlmSubmit(1, "Hello.", "tara"))
        eng.emit("1-0", audio(frames(2)))
        await svc.pump()
        sink.full, sink.timeouts = True, 2
        eng.emit("1-0", [EOS], "stop")
        svc.on_step()
        for _ in range(200):  # the pump retries the END every 50 ms
            await asyncio.sleep(0.01)
            if received(sink.records)[1].end is not None:
                break
        got = received(sink.records)[1]
        assert len(sink.waits) >= 2 and all(w[0] == RecordKind.END for w in sink.waits)
        assert contiguous(got) and got.end is not None and got.end.reason == "stop"
    finally:
        pump.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pump


async def test_a_stream_cancelled_while_the_pump_waits_for_space_gets_no_more_codes() -> None:
    svc, eng, sink = make()
    await svc.handle(LlmSubmit(1, "Hello.", "tara"))
    await svc.handle(LlmSubmit(2, "Hello.", "tara"))
    eng.emit("1-0", audio(frames(1)))
    eng.emit("2-0", audio(frames(1)))
    sink.full = True
    blocked = asyncio.Event()
    release = asyncio.Event()
    wait_put = sink.wait_put

    async def slow_wait(*args: Any) -> bool:
        blocked.set()
        await release.wait()
        return await wait_put(*args)

    sink.wait_put = slow_wait  # type: ignore[method-assign]
    step = asyncio.create_task(svc.pump())
    await blocked.wait()  # the pump waits for space while writing stream 1
    await svc.handle(LlmCancel(2))  # control messages go on meanwhile
    release.set()
    await step
    await svc.pump()
    got = received(sink.records)
    assert got[1].seqs == [0] and got[1].end is None
    assert got[2].end is not None and got[2].end.reason == "cancelled" and not got[2].codes
    assert [r.stream_id for r in sink.records if r.kind == RecordKind.END] == [2]


# -- voices and sampling ----------------------------------------------------------------------


class Loras:
    def get(self, voice: str) -> Any:
        if voice == "myvoice":
            return SimpleNamespace(request="lora-request", speaker="spk")
        return None


class Custom:
    def has(self, voice: str) -> bool:
        return voice in ("clone", "damaged", "deleted")

    def prefix(self, voice: str) -> tuple[int, ...] | None:
        if voice == "clone":
            return (11, 12, 13)
        if voice == "damaged":
            raise BadRequest("custom voice 'damaged' cannot be read: bad file")
        return None


def make_voices() -> tuple[LLMService, FakeEngine, MemorySink]:
    config = LLMConfig(model="unused", max_model_len=2048, max_chars_per_segment=40)
    eng, sink = FakeEngine(), MemorySink()
    svc = LLMService(config, eng, sink, FakePrompts(), INFO, None, Custom(), Loras())  # type: ignore[arg-type]
    return svc, eng, sink


async def test_a_lora_voice_runs_with_its_adapter_and_speaker() -> None:
    svc, eng, _ = make_voices()
    await svc.handle(LlmSubmit(1, "Hello.", "MyVoice"))
    (req,) = eng.requests
    assert req.lora == "lora-request" and spoken(req.prompt) == "spk: Hello."
    await svc.handle(LlmSubmit(2, "Hello.", "tara"))
    assert eng.requests[1].lora is None and spoken(eng.requests[1].prompt) == "tara: Hello."


async def test_a_zero_shot_voice_is_its_prefix_then_the_plain_text() -> None:
    svc, eng, _ = make_voices()
    await svc.handle(LlmSubmit(1, f"{PIECES[0]} {PIECES[1]}", "clone"))
    await finish(svc, eng, 1, frames(1), "stop")
    for req, piece in zip(eng.requests, PIECES, strict=False):
        assert tuple(req.prompt[:3]) == (11, 12, 13) and req.lora is None
        assert spoken(req.prompt) == piece, "no voice name in a zero-shot prompt"


@pytest.mark.parametrize(
    ("voice", "fragment"),
    [("damaged", "cannot be read"), ("nobody", "unknown voice"), ("deleted", "unknown voice")],
)
async def test_a_voice_that_cannot_be_served_is_a_400(voice: str, fragment: str) -> None:
    svc, eng, sink = make_voices()
    await svc.handle(LlmSubmit(1, "Hello.", voice))
    await svc.pump()
    err = received(sink.records)[1].error
    assert err is not None and err.status == 400 and fragment in err.message
    assert not eng.requests


class Hooks(SamplingHooks):
    def __init__(self) -> None:
        self.released: list[Any] = []
        self.n = 0

    def acquire(self) -> Any:
        self.n += 1
        return f"slot-{self.n}"

    def kwargs(self, sampling: VoiceSampling, counter: Any) -> dict[str, Any]:
        return {**super().kwargs(sampling, counter), "extra_args": {"slot": counter}}

    def release(self, counter: Any) -> int:
        self.released.append(counter)
        return 5


async def test_sampling_hooks_follow_the_stream() -> None:
    config = LLMConfig(model="unused", max_model_len=2048, max_chars_per_segment=40)
    eng, sink, hooks = FakeEngine(), MemorySink(), Hooks()
    svc = LLMService(config, eng, sink, FakePrompts(), INFO, hooks)
    await svc.handle(LlmSubmit(1, f"{PIECES[0]} {PIECES[1]}", "tara"))
    await svc.handle(LlmSubmit(2, "Hello.", "nobody"))  # rejected: takes no slot
    await svc.handle(LlmSubmit(3, "Hello.", "tara"))
    await finish(svc, eng, 1, frames(1), "stop")
    await finish(svc, eng, 1, frames(1), "stop")
    eng.fail("3-0", RuntimeError("x"))
    await svc.pump()
    assert [r.params.extra_args for r in eng.requests] == [
        {"slot": "slot-1"},
        {"slot": "slot-2"},
        {"slot": "slot-1"},
    ]
    assert eng.requests[0].params.repetition_penalty == 1.1
    assert hooks.released == ["slot-1", "slot-2"], "every stream gives its slot back"
    got = received(sink.records)
    assert got[1].end is not None and got[1].end.invalid_tokens_prevented == 5


# -- an invariant ------------------------------------------------------------------------------


@st.composite
def segments(draw: st.DrawFn) -> list[tuple[np.ndarray, int, str]]:
    """Per segment: its complete frames, the extra tokens of an unfinished frame, its end."""
    n = draw(st.integers(1, 3))
    return [
        (
            frames(draw(st.integers(0, 6)), draw(st.integers(0, 99))),
            draw(st.integers(0, 6)),
            draw(st.sampled_from(["stop", "length"])),
        )
        for _ in range(n)
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(segments(), min_size=1, max_size=3),
    cuts=st.lists(st.integers(1, 9), min_size=60, max_size=60),
    per_record=st.integers(1, 4),
)
def test_frames_seq_is_continuous_for_any_split_into_steps_and_segments(
    plan: list[list[tuple[np.ndarray, int, str]]], cuts: list[int], per_record: int
) -> None:
    """Several streams, each one to three segments; every segment's tokens cut into steps
    of any size. Each stream's CODES are its complete frames in order with seq counting
    them across segments, records never exceed the sink's payload, END closes the count."""
    asyncio.run(_continuous(plan, cuts, per_record))


async def _continuous(
    plan: list[list[tuple[np.ndarray, int, str]]], cuts: list[int], per_record: int
) -> None:
    svc, eng, sink = make(MemorySink(max_payload=per_record * 7 * 2))
    # Each stream: a queue of (tokens, finish reason or None) deliveries, segment by segment.
    queues: dict[int, list[tuple[list[int], str | None]]] = {}
    cut = iter(cuts * 100)
    for sid, segs in enumerate(plan, start=1):
        q: list[tuple[list[int], str | None]] = []
        for f, extra, reason in segs:
            tokens = audio(f) + audio(frames(1, 7))[:extra]
            if reason == "stop":
                tokens.append(EOS)
            while len(tokens) > 1 and (k := next(cut)) < len(tokens):
                q.append((tokens[:k], None))
                tokens = tokens[k:]
            q.append((tokens, reason))
        queues[sid] = q
        await svc.handle(LlmSubmit(sid, " ".join(PIECES[: len(segs)]), "tara"))
    while any(queues.values()):
        for sid, q in queues.items():
            if q:
                tokens, reason = q.pop(0)
                eng.emit(eng.current(sid).request_id, tokens, reason)
        await svc.pump()
    got = received(sink.records)
    for sid, segs in enumerate(plan, start=1):
        g: Received = got[sid]
        expect = np.concatenate([f for f, _, _ in segs])
        assert contiguous(g) and np.array_equal(g.frames, expect)
        assert all(len(x) <= per_record for _, x in g.codes)
        assert g.end is not None and g.after_end == 0
        assert g.end.tokens == sum(7 * len(f) + extra for f, extra, _ in segs)
        worst = "length" if any(r == "length" for _, _, r in segs) else "stop"
        assert g.end.reason == worst
    assert svc.active_streams == 0 and not eng.live


# -- the engine's side ---------------------------------------------------------------------


async def test_generation_engine_feeds_token_ids_and_relays_steps() -> None:
    from vllm.inputs.engine import tokens_input

    from llm_worker.engine.engine import GenerationEngine
    from llm_worker.engine.step_hooks import StepHook, StepRelay

    calls: list[tuple[Any, ...]] = []

    class LLM:
        async def add_request(
            self, rid: str, prompt: Any, params: Any, lora_request: Any = None
        ) -> str:
            calls.append(("add", rid, prompt, params, lora_request))
            return "collector"

        async def abort(self, rid: str) -> None:
            calls.append(("abort", rid))

    relay = StepRelay()
    engine = GenerationEngine(LLM(), relay)  # type: ignore[arg-type]
    assert await engine.add("1-0", [5, 6, 7], "params", "lora") == "collector"
    await engine.abort("1-0")
    assert calls == [("add", "1-0", tokens_input([5, 6, 7]), "params", "lora"), ("abort", "1-0")]
    hook = StepHook(None, 0, on_step=relay)  # type: ignore[arg-type]
    hook.record(None, None)  # before anyone listens (the warm-up): nothing happens
    steps: list[int] = []
    engine.on_step(lambda: steps.append(1))
    hook.record(None, None)
    hook.record(None, None)
    assert steps == [1, 1]


async def test_generation_engine_run_goes_through_the_one_entry_and_reads_to_the_end() -> None:
    """``run`` (the warm-up's) is ``add`` (the prompt converted once, to the output head's
    ids) and the collector read until the request finished."""
    from vllm.inputs.engine import tokens_input

    from llm_worker.engine.engine import GenerationEngine

    space = TokenSpace.audio(T.VOCAB_SIZE)
    added: list[tuple[str, Any]] = []

    def out(n: int, finished: bool) -> Any:
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=[2] * n)], finished=finished)

    class Collector:
        def __init__(self) -> None:
            self.outs = [out(3, False), out(0, False), out(2, True), out(9, False)]

        async def get(self) -> Any:
            return self.outs.pop(0)

    class LLM:
        async def add_request(
            self, rid: str, prompt: Any, params: Any, lora_request: Any = None
        ) -> Collector:
            added.append((rid, prompt))
            return Collector()

    engine = GenerationEngine(LLM(), space=space)  # type: ignore[arg-type]
    prompt = [T.START_OF_HUMAN, 1000, T.START_OF_SPEECH]
    assert await engine.run("warmup-0", prompt, "params") == 5  # type: ignore[arg-type]
    assert added == [("warmup-0", tokens_input(space.to_engine(prompt)))]
