"""The codec_worker process on real rings: started as the orchestrator starts it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq

from codec_worker.snac_model import SNAC_24KHZ_SMALL
from common.config import ServeConfig
from common.config.codec import CodecConfig
from orchestrator.child import SPEC_ENV, ChildSpec
from shm.config import ShmConfig
from shm.layout import InstanceLayout
from shm.messages import Heartbeat, WorkerReady, orchestrator_decoder
from shm.records import (
    RecordKind,
    StreamEnd,
    end_decoder,
    error_decoder,
    make_stream_id,
    record_encoder,
)
from shm.ring import RingReader, RingWriter
from shm.segments import create_instance
from testkit.tiny_model import write_random_snac


def test_codec_worker_process_decodes_streams_from_the_code_ring(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    snac_dir = write_random_snac(tmp_path / "snac", seed=1, config=SNAC_24KHZ_SMALL)
    config = ServeConfig(
        device="cpu",
        codec=CodecConfig(model=str(snac_dir), threads=1, max_hop_frames=4),
        shm=ShmConfig(code_ring_bytes=1 << 16, pcm_ring_bytes=1 << 20, run_dir=layout.run_dir),
    )
    create_instance(layout, config.shm)
    orch = zmq.Context.instance().socket(zmq.PULL)
    orch.setsockopt(zmq.LINGER, 0)
    orch.bind(layout.orch)
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = dict(os.environ)
    env[SPEC_ENV] = msgspec.json.encode(ChildSpec(config, layout, os.getpid())).decode()
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.child", "codec"], env=env, stderr=subprocess.PIPE
    )
    codes = RingWriter(layout.engine_code_ring(0))
    pcm = RingReader(layout.pcm_ring(0))
    try:
        assert orch.poll(120_000), "the codec worker never said it was ready"
        ready = orchestrator_decoder.decode(orch.recv())
        assert isinstance(ready, WorkerReady) and ready.role == "codec" and ready.pid == proc.pid

        rng = np.random.default_rng(0)
        a, b, c = (make_stream_id(0, i) for i in (1, 2, 3))
        frames_a = rng.integers(0, 4096, (10, 7)).astype("<i2")
        for lo, hi in ((0, 3), (3, 4), (4, 10)):
            codes.append(RecordKind.CODES, a, lo, frames_a[lo:hi], timeout_s=5)
        codes.append(RecordKind.CODES, b, 0, frames_a[:6], timeout_s=5)
        codes.append(RecordKind.CODES, c, 0, frames_a[:2], timeout_s=5)
        codes.append(RecordKind.CODES, c, 3, frames_a[:2], timeout_s=5)  # frame 2 missing
        codes.append(RecordKind.END, a, 10, record_encoder.encode(StreamEnd("stop", 10)), 5)
        codes.append(RecordKind.END, b, 6, record_encoder.encode(StreamEnd("cancelled", 6)), 5)
        codes.publish()

        got: dict[int, list[tuple[int, int, bytes]]] = {a: [], b: [], c: []}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            r and r[-1][0] in (RecordKind.END, RecordKind.ERROR) for r in got.values()
        ):
            pcm.wait(0.5)
            for r in pcm.poll():
                got[r.stream_id].append((r.kind, r.seq, bytes(r.payload)))
            pcm.release()

        kinds_a = [k for k, _, _ in got[a]]
        assert kinds_a[-1] == RecordKind.END and set(kinds_a[:-1]) == {RecordKind.PCM}
        assert [s for _, s, _ in got[a]] == list(range(len(got[a])))
        assert sum(len(p) for k, _, p in got[a] if k == RecordKind.PCM) == 10 * 2048 * 2
        assert end_decoder.decode(got[a][-1][2]).frames == 10
        assert got[b][-1][0] == RecordKind.END
        assert end_decoder.decode(got[b][-1][2]).reason == "cancelled"
        assert [k for k, _, _ in got[c]][-1] == RecordKind.ERROR
        assert error_decoder.decode(got[c][-1][2]).code == "sequence_gap"

        assert orch.poll(5_000)
        assert isinstance(orchestrator_decoder.decode(orch.recv()), Heartbeat)
        assert any(metrics_dir.iterdir())  # multiprocess metrics files were written
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        codes.close()
        pcm.close()
        orch.close(linger=0)
    assert rc == 0, stderr
    assert "Traceback" not in stderr, stderr
