"""The llm_worker process against a real code ring: vLLM on CPU with the tiny model.

One worker process serves the whole module (vLLM's CPU start-up takes a minute or two).
The test plays the orchestrator (orch PULL, ring creation), a gateway (control PUSH) and
the codec worker (ring reader).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import psutil
import pytest
import zmq
from e2e_harness import note_engine_start
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from common.config import ServeConfig
from common.config.llm import LLMConfig
from common.profiling import ProfileDone
from orchestrator.child import SPEC_ENV, ChildSpec
from shm.layout import InstanceLayout
from shm.messages import (
    Heartbeat,
    LlmAppendText,
    LlmCancel,
    LlmSubmit,
    SamplingOverrides,
    WorkerReady,
    control_encoder,
    orchestrator_decoder,
)
from shm.records import RecordKind, StreamEnd, StreamError, end_decoder, error_decoder
from shm.ring import RingReader, create_ring
from shm.segments import destroy_instance
from testkit.tiny_model import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(900)]

READY_TIMEOUT_S = 600
STREAM_TIMEOUT_S = 120
RING_BYTES = 4096  # about 100 one-frame CODES records: small enough to fill in a test
RING_FULL_TIMEOUT_S = 2.0


@dataclass
class Received:
    codes: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (seq, frames)
    end: StreamEnd | None = None
    end_seq: int = -1
    error: StreamError | None = None
    after_end: int = 0

    @property
    def frames(self) -> np.ndarray:
        if not self.codes:
            return np.zeros((0, 7), np.int16)
        return np.concatenate([f for _, f in self.codes])


class Harness:
    def __init__(self, proc: subprocess.Popen[bytes], reader: RingReader, ctl: zmq.Socket,
                 orch: zmq.Socket, ready: WorkerReady, metrics_dir: Path,
                 profile_dir: Path) -> None:  # fmt: skip
        self.proc = proc
        self.metrics_dir = metrics_dir
        self.profile_dir = profile_dir
        self.reader = reader
        self.ctl = ctl
        self.orch = orch
        self.ready = ready
        self.streams: dict[int, Received] = {}
        self._next_id = 1

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def send(self, msg: LlmSubmit | LlmAppendText | LlmCancel) -> None:
        self.ctl.send(control_encoder.encode(msg))

    def pump(self) -> None:
        """Read every record now in the ring into ``streams``."""
        for rec in self.reader.poll():
            got = self.streams.setdefault(rec.stream_id, Received())
            if got.end is not None or got.error is not None:
                got.after_end += 1
            elif rec.kind == RecordKind.CODES:
                frames = np.frombuffer(rec.payload, dtype="<i2").reshape(-1, 7).copy()
                got.codes.append((rec.seq, frames))
            elif rec.kind == RecordKind.END:
                got.end = end_decoder.decode(rec.payload)
                got.end_seq = rec.seq
            elif rec.kind == RecordKind.ERROR:
                got.error = error_decoder.decode(rec.payload)
        self.reader.release()

    def wait_for(self, stream_id: int, timeout_s: float = STREAM_TIMEOUT_S,
                 first_codes: bool = False) -> Received:  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the worker died"
            self.pump()
            got = self.streams.get(stream_id)
            if got is not None and (got.end or got.error or (first_codes and got.codes)):
                return got
            self.reader.wait(0.2)
        raise AssertionError(f"stream {stream_id}: nothing conclusive in {timeout_s}s")


def _check_contiguous(got: Received) -> None:
    seq = 0
    for s, frames in got.codes:
        assert s == seq, "CODES seq counts frames with no gap or repeat"
        seq += len(frames)
    assert got.end is not None and got.end.frames == seq == got.end_seq
    frames = got.frames
    assert frames.min(initial=0) >= 0 and frames.max(initial=0) < 4096


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    root = tmp_path_factory.mktemp("llmw")
    model = root / "model"
    write_tiny_model(model)
    layout = InstanceLayout(instance=f"orpheus-{os.getpid()}-l{os.urandom(3).hex()}",
                            run_dir=str(root))  # fmt: skip
    os.makedirs(layout.socket_dir)
    create_ring(layout.engine_code_ring(0), RING_BYTES)
    config = ServeConfig(
        device="cpu",
        # float32: the random weights' bfloat16 logits tie at the top, and greedy sampling
        # (test_top_k_reaches_vllm) would then pick among the tied ids by the seed.
        llm=LLMConfig(model=str(model), max_model_len=1024, max_num_seqs=8,
                      enforce_eager=True, max_chars_per_segment=40, dtype="float32",
                      ring_full_timeout_s=RING_FULL_TIMEOUT_S),
    )  # fmt: skip
    zctx = zmq.Context.instance()
    orch = zctx.socket(zmq.PULL)
    orch.bind(layout.orch)
    reader = RingReader(layout.engine_code_ring(0))
    env = dict(os.environ)
    metrics_dir = root / "metrics"
    metrics_dir.mkdir()
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    profile_dir = root / "profile"  # the profiling hooks are armed (docs/gpu.md)
    env["ORPHEUS_PROFILE_DIR"] = str(profile_dir)
    env["ORPHEUS_PROFILE_SECONDS"] = "1"
    env[SPEC_ENV] = msgspec.json.encode(ChildSpec(config, layout, os.getpid())).decode()
    note_engine_start("llm worker")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.child", "llm"], env=env)
    ctl = zctx.socket(zmq.PUSH)
    ctl.connect(layout.engine_control(0))
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = None
        while ready is None:
            assert proc.poll() is None, f"worker exited with {proc.returncode} during start-up"
            assert time.monotonic() < deadline, "worker not ready in time"
            if orch.poll(500):
                msg = orchestrator_decoder.decode(orch.recv())
                if isinstance(msg, WorkerReady):
                    ready = msg
        yield Harness(proc, reader, ctl, orch, ready, metrics_dir, profile_dir)
    finally:
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
            ctl.close(0)
            orch.close(0)
            reader.close()
            destroy_instance(layout)
        assert code == 0, "SIGTERM stops the worker cleanly"
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"engine processes left behind: {alive}"


def test_ready_states_engine_setup(harness: Harness) -> None:
    detail = harness.ready.detail
    assert harness.ready.role == "llm"
    assert "model runner V1" in detail and "scheduling synchronous" in detail
    assert "attention backend" in detail and "device cpu" in detail
    # The warm-up batch ran before the worker said it was ready: every batch size up to
    # max_num_seqs (8 here; 72 where it allows, above vLLM's top-p kernel thresholds).
    assert "warm-up 8 rows (batches 8..1, 1 sampling setting)" in detail


def test_heartbeats(harness: Harness) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if harness.orch.poll(500):
            msg = orchestrator_decoder.decode(harness.orch.recv())
            if isinstance(msg, Heartbeat):
                assert msg.role == "llm" and msg.pid == harness.proc.pid
                return
    raise AssertionError("no heartbeat in 10 s")


def test_fixed_length_is_exact_and_seeded(harness: Harness) -> None:
    runs = []
    for _ in range(2):
        sid = harness.new_id()
        overrides = SamplingOverrides(max_tokens=7 * 10, seed=7)
        harness.send(LlmSubmit(sid, "Counting frames.", "tara", overrides))
        got = harness.wait_for(sid)
        _check_contiguous(got)
        assert got.end is not None and got.end.reason == "length"
        assert got.end.frames == 10 and got.end.tokens == 70
        runs.append(got.frames)
    assert np.array_equal(runs[0], runs[1]), "same seed, same codes"


def test_top_k_reaches_vllm(harness: Harness) -> None:
    """``top_k`` goes from ``LlmSubmit`` through the worker's plan into vLLM's sampler:
    top_k = 1 is greedy, so two seeds give the same codes; without it they differ."""

    def frames(seed: int, **sampling: int) -> np.ndarray:
        sid = harness.new_id()
        o = SamplingOverrides(max_tokens=7 * 8, seed=seed, temperature=1.0, **sampling)
        harness.send(LlmSubmit(sid, "Top k.", "tara", o))
        got = harness.wait_for(sid)
        _check_contiguous(got)
        return got.frames

    assert not np.array_equal(frames(1), frames(2)), "the seeds sample different codes"
    assert np.array_equal(frames(1, top_k=1), frames(2, top_k=1)), "top_k = 1: greedy"


def test_natural_end_of_speech(harness: Harness) -> None:
    sid = harness.new_id()
    # A low temperature makes the tiny model's end of speech likely at each frame boundary.
    harness.send(LlmSubmit(sid, "Hi.", "leo", SamplingOverrides(temperature=0.3, seed=3)))
    got = harness.wait_for(sid)
    _check_contiguous(got)
    assert got.end is not None and got.end.reason == "stop"
    assert got.end.frames >= 1 and got.end.tokens == 7 * got.end.frames


def test_long_text_is_one_in_order_stream(harness: Harness) -> None:
    sid = harness.new_id()
    text = "The first sentence is here. A second one follows it. And the third ends it all."
    harness.send(LlmSubmit(sid, text, "tara", SamplingOverrides(max_tokens=7 * 12, seed=5)))
    got = harness.wait_for(sid)
    _check_contiguous(got)
    # Three pieces of at most 40 characters, 4 frames each, seq never restarts.
    assert got.end is not None and got.end.frames == 12 and len(got.codes) >= 3


def test_open_text_streams_as_it_arrives(harness: Harness) -> None:
    sid = harness.new_id()
    overrides = SamplingOverrides(temperature=0.3, seed=11)
    harness.send(LlmSubmit(sid, "First part of it. Sec", "tara", overrides, text_open=True))
    first = harness.wait_for(sid, first_codes=True)
    assert first.codes and first.end is None, "speech starts before the text is complete"
    harness.send(LlmAppendText(sid, "ond part.", final=True))
    got = harness.wait_for(sid)
    _check_contiguous(got)
    assert got.end is not None and got.end.reason in ("stop", "length")


def test_cancel_ends_the_stream(harness: Harness) -> None:
    sid = harness.new_id()
    harness.send(LlmSubmit(sid, "A long sentence to be cut short.", "tara",
                        SamplingOverrides(max_tokens=7 * 200, seed=2)))  # fmt: skip
    harness.wait_for(sid, first_codes=True)
    harness.send(LlmCancel(sid))
    got = harness.wait_for(sid)
    _check_contiguous(got)
    assert got.end is not None and got.end.reason == "cancelled" and got.end.frames < 200
    time.sleep(1.0)
    harness.pump()
    assert got.after_end == 0, "nothing follows END"


@pytest.mark.parametrize(
    ("voice", "text", "fragment"),
    [("nobody", "Hello.", "unknown voice"), ("tara", "   ", "empty text")],
)
def test_bad_input_is_a_400(harness: Harness, voice: str, text: str, fragment: str) -> None:
    sid = harness.new_id()
    harness.send(LlmSubmit(sid, text, voice))
    got = harness.wait_for(sid, timeout_s=10)
    code = "empty_input" if fragment == "empty text" else "bad_request"  # the gateway's codes
    assert got.error is not None and got.error.status == 400 and got.error.code == code
    assert fragment in got.error.message and not got.codes


def test_concurrent_streams_all_complete(harness: Harness) -> None:
    ids = [harness.new_id() for _ in range(4)]
    for i, sid in enumerate(ids):
        harness.send(LlmSubmit(sid, f"Stream number {i}.", "zoe",
                            SamplingOverrides(max_tokens=7 * (3 + i), seed=i)))  # fmt: skip
    for i, sid in enumerate(ids):
        got = harness.wait_for(sid)
        _check_contiguous(got)
        assert got.end is not None and got.end.frames == 3 + i


def test_full_ring_is_backpressure_then_explicit_failure(harness: Harness) -> None:
    """The reader stops: the worker waits, then fails streams (ERROR backpressure) rather
    than dropping data; once the reader resumes, every stream ends explicitly, in order."""
    ids = [harness.new_id() for _ in range(8)]
    for i, sid in enumerate(ids):
        harness.send(LlmSubmit(sid, f"Backpressure {i}.", "tara",
                            SamplingOverrides(max_tokens=7 * 40, seed=i)))  # fmt: skip
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    while harness.reader.capacity - harness.reader.used_bytes() > 128:
        assert time.monotonic() < deadline, "the ring never filled"
        assert harness.proc.poll() is None
        time.sleep(0.2)
    time.sleep(2 * RING_FULL_TIMEOUT_S + 1)  # the worker gives up on a stream meanwhile
    for sid in ids:  # end the survivors quickly (a failed stream ignores its Cancel)
        harness.send(LlmCancel(sid))
    results = [harness.wait_for(sid) for sid in ids]
    failed = [r for r in results if r.error is not None]
    assert failed, "a stream that cannot be served is failed explicitly"
    for r in results:
        if r.error is not None:
            assert r.error.code == "backpressure" and r.error.status == 503
            sizes = [len(f) for _, f in r.codes]
            assert [seq for seq, _ in r.codes] == [sum(sizes[:k]) for k in range(len(sizes))]
        else:
            _check_contiguous(r)
    time.sleep(0.5)
    harness.pump()
    assert all(r.after_end == 0 for r in results)
    sid = harness.new_id()  # and the worker still serves
    harness.send(LlmSubmit(sid, "Still here.", "tara", SamplingOverrides(max_tokens=21, seed=1)))
    got = harness.wait_for(sid)
    _check_contiguous(got)
    assert got.end is not None and got.end.frames == 3


def test_metrics_reach_the_shared_directory(harness: Harness) -> None:
    """The worker's orpheus_llm_* and the engine's vllm:* metrics, one multiprocess scrape."""
    sid = harness.new_id()
    harness.send(LlmSubmit(sid, "Metrics.", "tara", SamplingOverrides(max_tokens=7 * 4, seed=1)))
    harness.wait_for(sid)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(harness.metrics_dir))
    values: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    assert values.get("orpheus_llm_frames_written_total", 0) >= 4
    assert values.get("orpheus_llm_tokens_per_step_count", 0) > 0
    assert "orpheus_llm_invalid_tokens_prevented_total" in values
    assert values.get("vllm:generation_tokens_total", 0) >= 28


def test_profile_trigger_captures_engine_traces(harness: Harness) -> None:
    """Writing DIR/trigger makes the armed worker capture vLLM's torch profile for
    ORPHEUS_PROFILE_SECONDS and report it in DIR/llm-<pid>.done."""
    done_path = harness.profile_dir / f"llm-{harness.proc.pid}.done"
    (harness.profile_dir / "trigger").write_text("unit-test")
    sid = harness.new_id()  # engine steps to trace while the capture runs
    harness.send(
        LlmSubmit(sid, "Profile me.", "tara", SamplingOverrides(max_tokens=7 * 30, seed=2))
    )
    harness.wait_for(sid)
    deadline = time.monotonic() + 120
    while not done_path.exists():
        assert time.monotonic() < deadline, "no .done file within 120 s of the trigger"
        time.sleep(0.25)
    done = msgspec.json.decode(done_path.read_bytes(), type=ProfileDone)
    assert done.error == "" and done.label == "unit-test" and done.role == "llm"
    assert done.files and all(Path(f).stat().st_size > 0 for f in done.files)
    assert all(Path(f).is_relative_to(harness.profile_dir / "engine") for f in done.files)
