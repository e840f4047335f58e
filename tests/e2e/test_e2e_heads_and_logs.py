"""Two real servers on the same tiny model that differ in two settings, each of no concern to
the other's tests: the output head (``llm.output_head = audio`` and ``full``) and the log
format (text and ``log_format = json``). One server per setting would be four engine
start-ups for what two carry.

**Heads.** Greedy speech through the whole server is the same with the audio head and the
full head: the same greedy requests (temperature 0, fixed length and natural end) give the
same audio, the same length and samples equal to within the codec's float noise (the codec
worker batches windows of whatever streams are in flight, and a convolution over another
batch shape may round a sample a few LSB the other way: the same request twice on one server
differs as much; the codec's late windows, whose seams differ by hundreds of LSB, are off
here). One different code would change a frame's 2048 samples by up to the signal's own
scale. Both start-up logs name the head in use.

**Logs** (issue 13), read after each server's SIGTERM, so each is one start, a few requests and
one stop: the text log has one line per phase at INFO and the libraries only their
warnings; the JSON log is JSON lines, vLLM's included, for a log shipper
(tests/harness/serve_logs.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from e2e_harness import NO_STORE, Server, start_server, stop_server
from serve_logs import check_json_log, check_text_log, stop_after_ready_line

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

REQUESTS = [
    {"input": "Counting frames, greedily.", "voice": "tara", "max_tokens": 7 * 9},
    {"input": "Hi there.", "voice": "leo"},
]


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    out: dict[str, tuple[Server, Path]] = {}
    logs = tmp_path_factory.mktemp("logs")
    try:
        for head, log_format in (("audio", "text"), ("full", "json")):
            log = logs / f"{head}.log"
            with log.open("wb") as f:
                # No late windows: one decodes a seam with a shorter lookahead when a stream
                # runs late, which on a loaded CPU may happen in one run and not the other.
                # Unmarked (codec.watermark=off): the heads decide the codes, and PerTh's mark
                # depends on where the codec cut the windows (up to 944 LSB between two cuts
                # of the same codes, docs/performance.md), which timing decides.
                argv = ["--set", f"llm.output_head={head}", "--set", "codec.late_lookahead_ms=-1",
                        "--set", "codec.watermark=off",
                        "--set", f"log_format={log_format}"]  # fmt: skip
                out[head] = (start_server(tiny_model, *argv, log=f), log)
        yield out
    finally:
        for srv, _ in out.values():
            assert stop_server(srv) == 0
            assert srv.segments_left() == []


async def speak(url: str, body: dict) -> bytes:
    req = {"model": "tts-1", "response_format": "pcm", "temperature": 0.0, "seed": 3, **body}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/audio/speech", json=req, headers=NO_STORE) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()


def test_greedy_speech_is_identical_with_the_audio_head(servers: dict) -> None:
    for body in REQUESTS:
        audio = asyncio.run(speak(servers["audio"][0].url, body))
        full = asyncio.run(speak(servers["full"][0].url, body))
        again = asyncio.run(speak(servers["audio"][0].url, body))
        assert len(audio) > 0 and len(audio) == len(full) == len(again), body
        a, f, g = (np.frombuffer(x, dtype="<i2").astype(np.int32) for x in (audio, full, again))
        cross, same = np.abs(a - f), np.abs(a - g)
        # Measured: peak 25,385; audio vs full at most 12 LSB, audio vs audio at most 11.
        noise = max(int(same.max()), 8)
        assert int(cross.max()) <= 4 * noise < int(np.abs(a).max()) // 100, (body, cross.max())
    audio_log = servers["audio"][1].read_text(errors="replace")
    full_log = servers["full"][1].read_text(errors="replace")
    assert "output head: audio (28,684 of 156,940 logits columns; configured)" in audio_log
    assert "output head: full (156,940 of 156,940 logits columns; configured)" in full_log


# -- the logs: each test stops its server (the fixture's stop then finds it stopped) ----------
def test_serve_logs_one_line_per_phase_and_only_the_libraries_warnings(servers: dict) -> None:
    srv, log_path = servers["audio"]
    assert stop_after_ready_line(srv, log_path) == 0
    text = log_path.read_text(errors="replace")
    streams = 2 * len(REQUESTS)  # each request twice on this server
    print(f"\nserve at INFO, start, {streams} streams and stop: {len(text.splitlines())} lines")
    check_text_log(text, streams)


def test_serve_json_logs_are_json_lines_vllm_included(servers: dict) -> None:
    srv, log_path = servers["full"]
    assert stop_after_ready_line(srv, log_path) == 0
    check_json_log(log_path.read_text(errors="replace"))
