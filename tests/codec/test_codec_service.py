"""The codec service: order under random arrival, END mid-batch, cancel, bad input, batching.

SNAC's real architecture with narrow channels (same strides and receptive field): these
tests are about scheduling and correctness, not the codec's cost.
"""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np
import pytest
import torch

from bench.codec.quality import error_db
from codec_worker.decoder import WindowDecoder
from codec_worker.engine import DecodeEngine
from codec_worker.noise import decode_seed
from codec_worker.output import CollectingSink
from codec_worker.policy import StreamState, WindowPolicy
from codec_worker.scheduler import Scheduler
from codec_worker.service import CodecService
from codec_worker.snac_model import SNAC_24KHZ_SMALL, fuse_weight_norm
from common.config.codec import CodecConfig
from shm.records import (
    RecordKind,
    StreamEnd,
    StreamError,
    end_decoder,
    error_decoder,
    make_stream_id,
    record_encoder,
)
from shm.ring import Record
from testkit.tiny_model import random_snac

torch.set_num_threads(1)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def decoder() -> WindowDecoder:
    return WindowDecoder(fuse_weight_norm(random_snac(0, SNAC_24KHZ_SMALL))).eval()


def make(
    decoder: WindowDecoder, clock: Clock | None = None, gateways: int = 1, **cfg_fields: object
) -> tuple[CodecService, CollectingSink]:
    cfg = msgspec.convert(cfg_fields, CodecConfig)
    sink = CollectingSink()
    engine = DecodeEngine.for_config(decoder, cfg, torch.device("cpu"))
    return CodecService(cfg, engine, sink, gateways, clock=clock or Clock()), sink


def codes_rec(sid: int, seq: int, codes: np.ndarray) -> Record:
    return Record(RecordKind.CODES, sid, seq, memoryview(codes.astype("<i2").tobytes()))


def end_rec(sid: int, seq: int, reason: str = "stop") -> Record:
    return Record(
        RecordKind.END, sid, seq, memoryview(record_encoder.encode(StreamEnd(reason, seq)))
    )


def settle(svc: CodecService) -> None:
    while svc.pump():
        pass


def by_stream(sink: CollectingSink) -> dict[int, list[tuple[int, int, bytes]]]:
    out: dict[int, list[tuple[int, int, bytes]]] = {}
    for _, kind, sid, seq, payload in sink.records:
        out.setdefault(sid, []).append((kind, seq, payload))
    return out


def audio(records: list[tuple[int, int, bytes]]) -> np.ndarray:
    return np.frombuffer(b"".join(p for k, _, p in records if k == RecordKind.PCM), "<i2")


def offline_pcm(decoder: WindowDecoder, sid: int, codes: np.ndarray) -> np.ndarray:
    frames = torch.from_numpy(codes.astype(np.int64))[None]
    with torch.inference_mode():
        out = decoder.decode_offline(frames, torch.tensor([decode_seed(0)]))[0]
    return (out * 32767).round().numpy()


def test_chunks_stay_in_order_under_random_arrival(decoder: WindowDecoder) -> None:
    rnd = random.Random(5)
    clock = Clock()
    svc, sink = make(decoder, clock, max_batch=3, max_hop_frames=4)
    rng = np.random.default_rng(5)
    streams = {
        make_stream_id(0, i): rng.integers(0, 4096, (rnd.randint(1, 25), 7)) for i in range(6)
    }
    sent = dict.fromkeys(streams, 0)
    live = set(streams)
    while live:
        sid = rnd.choice(sorted(live))
        n = min(rnd.randint(0, 5), len(streams[sid]) - sent[sid])
        batch = [codes_rec(sid, sent[sid], streams[sid][sent[sid] : sent[sid] + n])] if n else []
        sent[sid] += n
        if sent[sid] == len(streams[sid]) and rnd.random() < 0.5:
            batch.append(end_rec(sid, sent[sid]))
            live.discard(sid)
        svc.ingest(batch)
        for _ in range(rnd.randint(0, 2)):
            clock.t += rnd.choice([0.0, 0.003, 0.2])
            svc.pump()
    settle(svc)
    assert not svc.streams
    for sid, records in by_stream(sink).items():
        n = len(streams[sid])
        kinds = [k for k, _, _ in records]
        assert kinds[-1] == RecordKind.END and RecordKind.END not in kinds[:-1]
        assert [seq for _, seq, _ in records] == list(range(len(records)))
        end = end_decoder.decode(records[-1][2])
        assert (end.reason, end.frames) == ("stop", n)
        pcm = audio(records)
        assert len(pcm) == n * 2048  # every frame, the first and the last included
        assert error_db(pcm, offline_pcm(decoder, sid, streams[sid])) < -25.0


def test_batched_output_equals_unbatched_output(decoder: WindowDecoder) -> None:
    rng = np.random.default_rng(6)
    streams = {make_stream_id(0, i): rng.integers(0, 4096, (9, 7)) for i in range(5)}
    results = []
    for max_batch in (1, 16):
        # max_hop 1: every window has the same shape however the batches form.
        svc, sink = make(decoder, max_batch=max_batch, max_hop_frames=1, hold_ahead_ms=-1)
        for f in range(9):
            svc.ingest([codes_rec(sid, f, c[f : f + 1]) for sid, c in streams.items()])
            settle(svc)
        svc.ingest([end_rec(sid, 9) for sid in streams])
        settle(svc)
        assert svc.batches == (len(streams) * 9 if max_batch == 1 else 9)  # 9 windows each
        results.append({sid: audio(r) for sid, r in by_stream(sink).items()})
    for sid in streams:
        a, b = results[0][sid].astype(np.int32), results[1][sid].astype(np.int32)
        assert len(a) == 9 * 2048 and np.abs(a - b).max() <= 1  # float rounding at most


def test_a_stream_ending_mid_batch_emits_its_last_frames(decoder: WindowDecoder) -> None:
    svc, sink = make(decoder)
    rng = np.random.default_rng(7)
    a, b = make_stream_id(0, 1), make_stream_id(0, 2)
    ca, cb = rng.integers(0, 4096, (6, 7)), rng.integers(0, 4096, (4, 7))
    svc.ingest([codes_rec(a, 0, ca), codes_rec(b, 0, cb)])
    svc.pump()
    assert svc.busy  # both streams' first windows are in flight
    svc.ingest([end_rec(a, 6)])  # A ends while its window is in the batch
    settle(svc)
    assert a not in svc.streams and b in svc.streams
    records = by_stream(sink)[a]
    assert len(audio(records)) == 6 * 2048
    assert records[-1][0] == RecordKind.END and end_decoder.decode(records[-1][2]).frames == 6
    assert len(audio(by_stream(sink)[b])) < 4 * 2048  # B keeps its lookahead frames back


def test_cancel_drops_pending_windows_and_sends_no_more_audio(decoder: WindowDecoder) -> None:
    svc, sink = make(decoder)
    rng = np.random.default_rng(8)
    a, b = make_stream_id(0, 1), make_stream_id(0, 2)
    svc.ingest([codes_rec(a, 0, rng.integers(0, 4096, (3, 7)))])
    settle(svc)
    svc.ingest(
        [
            codes_rec(a, 3, rng.integers(0, 4096, (20, 7))),
            codes_rec(b, 0, rng.integers(0, 4096, (5, 7))),
        ]
    )
    svc.pump()
    assert svc.busy
    sent_before = len(by_stream(sink)[a])
    svc.ingest([end_rec(a, 23, "cancelled")])
    settle(svc)
    records = by_stream(sink)[a]
    # Only END(cancelled) after the cancel: the window in flight and the backlog are dropped.
    assert len(records) == sent_before + 1
    kind, seq, payload = records[-1]
    end = end_decoder.decode(payload)
    assert kind == RecordKind.END and end.reason == "cancelled" and seq == sent_before
    assert end.frames == len(audio(records)) // 2048
    assert a not in svc.streams
    svc.ingest([end_rec(b, 5)])
    settle(svc)
    assert len(audio(by_stream(sink)[b])) == 5 * 2048  # the other stream is untouched


def test_bad_input_fails_only_its_stream(decoder: WindowDecoder) -> None:
    svc, sink = make(decoder)
    ok, gap, bad, torn, upstream = (make_stream_id(0, i) for i in range(1, 6))
    good = np.zeros((4, 7), np.int16)
    out_of_range = good.copy()
    out_of_range[2, 5] = 4096
    error = StreamError(code="engine", message="boom")
    svc.ingest(
        [
            codes_rec(ok, 0, good),
            codes_rec(gap, 0, good),
            codes_rec(gap, 5, good),  # frames 4..5 lost
            codes_rec(gap, 9, good),  # ignored: the stream already failed
            codes_rec(bad, 0, out_of_range),
            Record(RecordKind.CODES, torn, 0, memoryview(b"\x00" * 15)),
            codes_rec(upstream, 0, good),
            Record(RecordKind.ERROR, upstream, 4, memoryview(msgspec.msgpack.encode(error))),
            end_rec(gap, 13),  # the llm_worker's END of a failed stream is swallowed
            end_rec(ok, 4),
        ]
    )
    settle(svc)
    streams = by_stream(sink)
    codes = {}
    for sid in (gap, bad, torn, upstream):
        assert len(streams[sid]) == 1 and streams[sid][0][0] == RecordKind.ERROR
        codes[sid] = error_decoder.decode(streams[sid][0][2]).code
    assert codes == {gap: "sequence_gap", bad: "bad_codes", torn: "bad_codes", upstream: "engine"}
    assert len(audio(streams[ok])) == 4 * 2048 and streams[ok][-1][0] == RecordKind.END
    assert not svc.streams


def test_streams_of_several_engines_share_a_batch_and_a_reset_fails_only_its_rings(
    decoder: WindowDecoder,
) -> None:
    """Two engines' code rings (sources 0 and 1) feed one service: their streams decode in the
    same batches, and a restarted engine's RESET fails the streams of its ring only."""
    svc, sink = make(decoder, max_batch=8)
    a, b = make_stream_id(0, 1), make_stream_id(0, 2)
    frames = np.zeros((8, 7), np.int16)
    svc.ingest([codes_rec(a, 0, frames)], source=0)
    svc.ingest([codes_rec(b, 0, frames)], source=1)
    settle(svc)
    assert svc.batches < svc.windows, "windows of both engines' streams were batched together"
    svc.ingest([Record(RecordKind.RESET, 0, 0, memoryview(b""))], source=1)
    settle(svc)
    streams = by_stream(sink)
    assert streams[b][-1][0] == RecordKind.ERROR
    assert error_decoder.decode(streams[b][-1][2]).code == "worker_restarted"
    assert set(svc.streams) == {a}, "engine 0's stream goes on"
    svc.ingest([codes_rec(a, 8, frames), end_rec(a, 16)], source=0)
    settle(svc)
    assert by_stream(sink)[a][-1][0] == RecordKind.END


def test_a_stream_without_frames_ends_at_once(decoder: WindowDecoder) -> None:
    svc, sink = make(decoder)
    sid = make_stream_id(0, 9)
    svc.ingest([end_rec(sid, 0, "length")])
    svc.pump()
    assert [(k, s) for _, k, _, s, _ in sink.records] == [(RecordKind.END, 0)]
    assert end_decoder.decode(sink.records[0][4]) == StreamEnd("length", 0)


def _ready_state(sid: int, frames: int, play_start: float, written: int) -> StreamState:
    s = StreamState(stream_id=sid, gateway=0, seed=0, created=0.0)
    s.append(np.zeros((frames, 7), np.int16), 0)
    s.scheduled = s.written = written
    s.play_start = play_start
    return s


def test_scheduler_waits_for_partners_then_serves_earliest_deadlines_first() -> None:
    cfg = CodecConfig(max_batch=2, max_wait_ms=5.0, hold_ahead_ms=-1)
    sched = Scheduler(cfg, WindowPolicy(cfg))
    now = 10.0
    late = _ready_state(1, 6, play_start=now - 1.0, written=3)
    soon = _ready_state(2, 6, play_start=now - 0.1, written=3)
    later = _ready_state(3, 6, play_start=now + 0.2, written=3)
    idle = _ready_state(4, 3, play_start=now, written=3)  # waits for frames
    sched.decode_estimate_s = 0.0
    # 'late' is already past its deadline: dispatch at once, earliest deadlines first.
    picked = sched.select([later, soon, late, idle], now)
    assert [w.state.stream_id for w in picked] == [1, 2]
    # Without an overdue stream the batch waits up to max_wait for partners.
    a = _ready_state(5, 6, play_start=now, written=3)
    a.ready_since = math.nan
    assert sched.select([a, idle], now) == []
    assert sched.wakeup_at == pytest.approx(now + 0.005)
    assert [w.state.stream_id for w in sched.select([a, idle], now + 0.005)] == [5]
    # When every live stream already has a window, waiting gains nothing.
    b = _ready_state(6, 6, play_start=now, written=3)
    assert len(sched.select([b], now)) == 1


def test_a_stream_ahead_of_playback_is_held_for_a_longer_window() -> None:
    cfg = CodecConfig(max_hop_frames=8, hold_ahead_ms=500.0, max_wait_ms=0.0)
    sched = Scheduler(cfg, WindowPolicy(cfg))
    now = 10.0
    # 40 frames written, playback started 1 s ago: 2.4 s of audio still to play.
    s = _ready_state(1, 44, play_start=now - 1.0, written=40)
    assert sched.select([s], now) == []  # 2 ready frames: held
    assert sched.wakeup_at == pytest.approx(now - 1.0 + 40 * 2048 / 24000 - 0.5)
    s.append(np.zeros((8, 7), np.int16), 0)  # now a full max_hop window is ready
    (w,) = sched.select([s], now)
    assert w.key.hop == 8


def test_a_stream_about_to_miss_its_deadline_takes_the_short_lookahead_window() -> None:
    cfg = CodecConfig(lookahead_frames=2, first_lookahead_frames=1, late_lookahead_ms=20.0)
    sched = Scheduler(cfg, WindowPolicy(cfg))
    sched.decode_estimate_s = 0.03
    frame_s = 2048 / 24000
    play_start = 10.0
    # One chunk written, two frames more received: the steady window needs a third.
    s = _ready_state(1, 3, play_start=play_start, written=1)
    due = play_start + frame_s - 0.03 - 0.02
    assert sched.select([s], due - 0.01) == []
    assert sched.wakeup_at == pytest.approx(due)  # woken when it must act, not at a frame
    (w,) = sched.select([s], due)
    assert (w.key.hop, w.key.lookahead, w.late) == (1, 1, True)
    never = CodecConfig(lookahead_frames=2, first_lookahead_frames=1, late_lookahead_ms=-1)
    waits = Scheduler(never, WindowPolicy(never))
    assert waits.select([_ready_state(2, 3, play_start=play_start, written=1)], due + 1) == []
