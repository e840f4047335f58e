"""The watermark in the codec worker: PerTh's own detector reads every streamed chunk's mark,
the seams of marked streams stay as clean as unmarked ones, and a watermark that cannot load
stops the start (codec_worker/watermark/)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from c2pa_certs import SIGNER_NAME, make_chain
from perth_oracle import MARKED, UNMARKED, perth_scores, write_wav

from bench.codec.quality import error_db
from codec_worker.decoder import WindowDecoder
from codec_worker.engine import DecodeEngine
from codec_worker.main import build_engine
from codec_worker.noise import decode_seed
from codec_worker.output import CollectingSink
from codec_worker.service import CodecService
from codec_worker.snac_model import SNAC_24KHZ, fuse_weight_norm
from codec_worker.watermark import WatermarkUnavailable, load_watermark
from codec_worker.watermark.perth import PerthWatermark
from common.config import ServeConfig
from common.config.codec import CodecConfig
from common.config.jobs import JobsConfig
from common.provenance.manifest import DIGITAL_SOURCE_TYPE
from common.provenance.signing import load_signer
from orchestrator.failures import classify
from shm.records import RecordKind, StreamEnd, record_encoder
from shm.ring import Record
from testkit.tiny_model import random_snac

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[3]
FRAMES = 36
"""3 s of audio: PerTh reads a clip's mean over its frames."""


@pytest.fixture(scope="module")
def snac_model() -> torch.nn.Module:
    return fuse_weight_norm(random_snac(0, SNAC_24KHZ))


@pytest.fixture(scope="module")
def decoder(snac_model: torch.nn.Module) -> WindowDecoder:
    return WindowDecoder(snac_model).eval()


@pytest.fixture(scope="module")
def perth() -> PerthWatermark:
    return PerthWatermark(torch.device("cpu"))


def _codes(seed: int, n: int = FRAMES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, (n, 7)).astype("<i2")


def _stream(engine: DecodeEngine, streams: dict[int, np.ndarray], step: int = 1) -> dict:
    """Feed each stream's codes ``step`` frames at a time (all streams in the same polls, so
    their windows share batches), then END; the PCM each stream got, and its chunk count."""
    cfg = engine.cfg
    sink = CollectingSink()
    svc = CodecService(cfg, engine, sink, 1)
    n = max(len(c) for c in streams.values())
    for a in range(0, n, step):
        recs = [
            Record(RecordKind.CODES, sid, a, memoryview(c[a : a + step].tobytes()))
            for sid, c in streams.items()
            if a < len(c)
        ]
        svc.ingest(recs)
        while svc.pump():
            pass
    for sid, c in streams.items():
        end = record_encoder.encode(StreamEnd("stop", len(c)))
        svc.ingest([Record(RecordKind.END, sid, len(c), memoryview(end))])
    while svc.pump():
        pass
    out: dict[int, tuple[np.ndarray, int]] = {}
    for sid in streams:
        pcm = [r for r in sink.records if r[1] == RecordKind.PCM and r[2] == sid]
        out[sid] = (np.frombuffer(b"".join(r[4] for r in pcm), dtype="<i2"), len(pcm))
    assert not svc.streams, "every stream ended and its state (and slot) went"
    return out


def _engine(decoder: WindowDecoder, watermark: PerthWatermark | None) -> DecodeEngine:
    cfg = CodecConfig(max_hop_frames=4)
    return DecodeEngine.for_config(decoder, cfg, torch.device("cpu"), watermark)


@torch.inference_mode()
def _offline(decoder: WindowDecoder, codes: np.ndarray) -> torch.Tensor:
    frames = torch.from_numpy(codes.astype(np.int64))[None]
    return decoder.decode_offline(frames, torch.tensor([decode_seed(0)]))


def test_perth_reads_the_codec_worker_s_marks_and_not_unmarked_audio(
    snac_model: torch.nn.Module, tmp_path: Path
) -> None:
    """The worker's engine as it starts (build_engine, codec.watermark perth and off), streams
    of one-frame polls: PerTh's own detector reads >= 0.9 on marked, <= 0.1 on unmarked."""
    files = {}
    for kind in ("perth", "off"):
        config = ServeConfig(device="cpu", codec=CodecConfig(watermark=kind, max_hop_frames=4))
        engine, _ = build_engine(config, snac_model)
        assert (engine.watermark is None) == (kind == "off")
        got = _stream(engine, {1: _codes(1), 2: _codes(2)})
        for sid, (pcm, chunks) in got.items():
            assert len(pcm) == FRAMES * 2048 and chunks >= 8
            files[(kind, sid)] = write_wav(tmp_path / f"{kind}-{sid}.wav", pcm, 24_000)
    scores = perth_scores(list(files.values()))
    for (kind, sid), path in files.items():
        s = scores[str(path)]
        print(f"codec.watermark={kind}, stream {sid}: PerTh reads {s:.3f}")
        assert s >= MARKED if kind == "perth" else s <= UNMARKED, (kind, sid, s)


def test_marked_streams_join_like_one_pass(decoder: WindowDecoder, perth: PerthWatermark) -> None:
    """Streamed marked audio against one offline decode marked in one pass, bounded as the
    unmarked seam test bounds streamed against offline (-30 dB), frames arriving one at a
    time (every seam a one-frame hop: the worst case). Measured: -54 dB unmarked, -40 dB
    marked (-27 dB without the mirrored look-ahead), the mark itself at -13.5 dB."""
    codes = _codes(4)
    plain = _stream(_engine(decoder, None), {5: codes})[5][0]
    marked = _stream(_engine(decoder, perth), {5: codes})[5][0]
    offline = _offline(decoder, codes)
    with torch.inference_mode():
        one_pass = perth.mark(offline, torch.tensor([perth.acquire()]), torch.tensor([True]))
    off_pcm = (offline[0] * 32767).round().numpy()
    one_pass_pcm = (one_pass[0] * 32767).round().numpy()
    plain_db, marked_db = error_db(plain, off_pcm), error_db(marked, one_pass_pcm)
    mark_db = error_db(one_pass_pcm, off_pcm)
    print(f"\nseams: unmarked {plain_db:.1f} dB, marked {marked_db:.1f} dB, mark {mark_db:.1f} dB")
    assert plain_db < -30.0
    assert marked_db < -30.0, "marked chunks join as the unmarked seam test requires"
    assert marked_db < mark_db - 15.0, "the streamed mark is the one-pass mark, not another"


@torch.inference_mode()
def test_batched_streams_and_reused_slots_mark_as_alone(
    decoder: WindowDecoder, perth: PerthWatermark
) -> None:
    """Two streams' chunks marked in one batch get what each gets marked alone, chunk after
    chunk; a slot released and reused by a later stream starts from silence, not from the
    earlier stream's tail. (Through the service, the windows' layout follows the measured
    decode time, so the marks of two runs differ where their chunks' edges do.)"""
    audio = torch.cat([_offline(decoder, _codes(s, 12)) for s in (7, 8)])  # (2, 12 * 2048)
    chunks = [(0, 2048), (2048, 6144), (6144, 8192), (8192, 24576)]

    def run(rows: list[int], slots: list[int]) -> torch.Tensor:
        slot_t = torch.tensor(slots)
        out = [
            perth.mark(audio[rows, a:b], slot_t, torch.full((len(rows),), a == 0))
            for a, b in chunks
        ]
        return torch.cat(out, dim=1)

    s1, s2 = perth.acquire(), perth.acquire()
    together = run([0, 1], [s1, s2])
    perth.release(s1)
    perth.release(s2)
    s3 = perth.acquire()
    assert s3 in (s1, s2), "a released slot is reused"
    alone = [run([0], [s3]), run([1], [s3])]
    perth.release(s3)
    for i in range(2):
        diff = (together[i] - alone[i][0]).abs().max().item()
        assert diff < 1e-4, f"stream {i}: batched marks differ from single ones by {diff}"
    assert (together[0] - audio[0]).abs().max().item() > 1e-3, "the audio was marked"


def test_the_project_s_reading_agrees_with_perth_s(
    decoder: WindowDecoder, perth: PerthWatermark, tmp_path: Path
) -> None:
    """PerthWatermark.score (what `watermark detect` prints) against PerTh's own detector."""
    codes = _codes(9)
    offline = _offline(decoder, codes)
    with torch.inference_mode():
        marked = perth.mark(offline, torch.tensor([perth.acquire()]), torch.tensor([True]))[0]
    clips = {"marked": marked.numpy(), "unmarked": offline[0].numpy()}
    paths = {k: write_wav(tmp_path / f"{k}.wav", v, 24_000) for k, v in clips.items()}
    theirs = perth_scores(list(paths.values()))
    for k, clip in clips.items():
        ours = perth.score(torch.from_numpy(np.round(clip * 32767) / 32767).float())
        print(f"{k}: ours {ours:.3f}, PerTh's {theirs[str(paths[k])]:.3f}")
        assert abs(ours - theirs[str(paths[k])]) < 0.05
    assert perth.score(marked) >= MARKED and perth.score(offline[0]) <= UNMARKED


def test_a_watermark_that_cannot_load_is_a_permanent_one_line_failure(tmp_path: Path) -> None:
    """A perth package without its network (a broken install): WatermarkUnavailable, which
    the orchestrator classifies as permanent (exit 78) with the fix in one line."""
    broken = tmp_path / "site" / "perth"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    code = (
        "from codec_worker.watermark import load_watermark\n"
        "import torch\n"
        "load_watermark('perth', torch.device('cpu'))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{broken.parent}{os.pathsep}{ROOT}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0
    assert "WatermarkUnavailable: PerTh watermark unloadable" in r.stderr, r.stderr[-2000:]
    with pytest.raises(WatermarkUnavailable) as unknown:
        load_watermark("audioseal", torch.device("cpu"))
    config = ServeConfig(device="cpu")
    try:
        raise RuntimeError("codec start-up failed") from unknown.value
    except RuntimeError as chained:
        failure = classify("codec", chained, config)
    assert failure is not None
    assert failure.cause.startswith("the perth watermark cannot load")
    assert "codec.watermark=off" in failure.fix and "\n" not in failure.line()


def test_the_detect_command_reads_files_and_says_so_in_its_exit_code(
    decoder: WindowDecoder, perth: PerthWatermark, tmp_path: Path
) -> None:
    """`orpheus-serve watermark detect FILE...`: a verdict per file; exit 0 all marked, 1 one
    unmarked, 2 one unreadable."""
    offline = _offline(decoder, _codes(10))
    with torch.inference_mode():
        marked = perth.mark(offline, torch.tensor([perth.acquire()]), torch.tensor([True]))[0]
    m = write_wav(tmp_path / "marked.wav", marked.numpy(), 24_000)
    u = write_wav(tmp_path / "unmarked.wav", offline[0].numpy(), 24_000)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF garbage" * 40)

    def run(*files: Path | str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "orpheus_serve", "watermark", "detect", *map(str, files)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)

    r = run(m)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{m}: marked (perth 1.000, 3.07 s at 24000 Hz)"), r.stdout
    r = run(m, u)
    assert r.returncode == 1 and f"{u}: unmarked (perth 0.000" in r.stdout, r.stdout
    r = run(m, u, bad, tmp_path / "missing.wav")
    assert r.returncode == 2, r.stdout
    assert (
        f"{bad}: unreadable: " in r.stdout and f"{tmp_path / 'missing.wav'}: unreadable" in r.stdout
    )
    # A long-form job's file: marked and signed (C2PA); the command reads both layers.
    chain = make_chain(tmp_path)
    signer = load_signer(JobsConfig(c2pa_cert=str(chain.cert), c2pa_key=str(chain.key)), "m")
    assert signer is not None
    signed = tmp_path / "job.wav"
    with signed.open("wb") as out:
        signer.sign(io.BytesIO(m.read_bytes()), out, "wav", signed.name)
    anchors = tmp_path / "anchors.pem"
    anchors.write_text(chain.root_pem)
    r = run(signed, "--trust-anchors", anchors)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{signed}: marked (perth 1.000"), r.stdout
    assert lines[1].startswith(f"  C2PA manifest: valid, trusted; signer {SIGNER_NAME}"), r.stdout
    assert f"source {DIGITAL_SOURCE_TYPE}" in lines[1], r.stdout
    r = run(m, "--trust-anchors", anchors)  # no manifest: no C2PA line
    assert r.returncode == 0 and "C2PA" not in r.stdout, r.stdout


@torch.inference_mode()
def test_the_tail_pool_grows_without_losing_a_stream_s_past(decoder: WindowDecoder) -> None:
    """More streams than the pool's first 64 slots: it doubles, and a stream marked across
    the growth gets what it gets without it."""
    audio = _offline(decoder, _codes(12, 4))  # (1, 4 * 2048)
    first, second = audio[:, :4096], audio[:, 4096:]

    def marked(grow: bool) -> torch.Tensor:
        wm = PerthWatermark(torch.device("cpu"))
        slot = torch.tensor([wm.acquire()])
        a = wm.mark(first, slot, torch.tensor([True]))
        if grow:
            others = [wm.acquire() for _ in range(100)]
            assert max(others) > 64 and len(set(others)) == 100
        b = wm.mark(second, slot, torch.tensor([False]))
        return torch.cat((a, b), dim=1)

    assert torch.equal(marked(grow=False), marked(grow=True))
