"""A long-form job's WAV and MP3 files carry a C2PA manifest signed with the operator's
certificate (``jobs.c2pa_cert``/``jobs.c2pa_key``; a throwaway chain made at test time),
verified by c2pa-python's own ``Reader`` against the test root (issue 58, part 4), with the
audio unchanged; formats C2PA does not embed in (pcm) are written as before; unconfigured,
files are unsigned and the gateway says so at start."""

from __future__ import annotations

import asyncio
import io
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import av
import c2pa
import pytest
from c2pa_certs import SIGNER_NAME, make_chain
from gateway_harness import Harness, running_gateway

from common.config.jobs import JobsConfig
from common.config.llm import LLMConfig
from common.provenance.manifest import DIGITAL_SOURCE_TYPE
from common.provenance.reading import read_provenance
from common.provenance.signing import SigningFailed
from gateway.jobs.store import write_atomic
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(90)

FRAMES = 6
"""Frames of audio per unit (the jobs set max_tokens = 7 * FRAMES)."""
TEXT = " ".join(f"Sentence number {i} is here." for i in range(4))
SAMPLES = 4 * FRAMES * 2048
MODEL = "canopylabs/orpheus-3b-0.1-ft"
KEY = "k"


async def run_job(s: aiohttp.ClientSession, h: Harness, **kw: Any) -> tuple[dict[str, Any], bytes]:
    """Submit a job, wait until it is done: its last state and its file."""
    body = {"input": TEXT, "voice": "tara", "max_tokens": 7 * FRAMES, **kw}
    hdr = {"Authorization": f"Bearer {KEY}"}
    async with s.post(f"{h.url}/v1/audio/jobs", json=body, headers=hdr) as r:
        assert r.status == 202, await r.text()
        job_id = (await r.json())["id"]
    deadline = time.monotonic() + 30
    while True:
        async with s.get(f"{h.url}/v1/audio/jobs/{job_id}", headers=hdr) as r:
            job = await r.json()
        if job["state"] not in ("queued", "running"):
            break
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.05)
    assert job["state"] == "done", job
    async with s.get(f"{h.url}/v1/audio/jobs/{job_id}/audio", headers=hdr) as r:
        assert r.status == 200
        return job, await r.read()


def decoded_samples(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as c:
        return sum(f.samples for f in c.decode(audio=0))


async def test_a_job_s_wav_and_mp3_are_signed_and_verify(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    chain = make_chain(tmp_path)
    jobs = JobsConfig(
        dir=str(tmp_path / "jobs"), poll_s=0.05, c2pa_cert=str(chain.cert), c2pa_key=str(chain.key)
    )
    serve = {"jobs": jobs, "llm": LLMConfig(model=MODEL)}
    trust = {"verify": {"verify_trust": True}, "trust": {"trust_anchors": chain.root_pem}}
    async with (
        running_gateway(layout, serve=serve, api_keys=[KEY]) as h,
        aiohttp.ClientSession() as s,
    ):
        for codec, rate in (("wav", 24000), ("wav", 16000), ("mp3", 24000)):
            job, data = await run_job(s, h, response_format=codec, sample_rate=rate)
            assert job["audio_bytes"] == len(data)
            path = tmp_path / f"out-{rate}.{codec}"
            path.write_bytes(data)
            # The oracle: c2pa-python's Reader, trusting the test root.
            with (
                open(path, "rb") as f,
                c2pa.Reader(f"audio/{codec}", f, context=c2pa.Context.from_dict(trust)) as r,
            ):
                assert r.get_validation_state() == "Trusted", r.get_validation_results()
                manifest = r.get_active_manifest()
            (created,) = [
                a
                for x in manifest["assertions"]
                if x["label"].startswith("c2pa.actions")
                for a in x["data"]["actions"]
            ]
            assert created["action"] == "c2pa.created"
            assert created["digitalSourceType"] == DIGITAL_SOURCE_TYPE
            assert created["parameters"] == {"model": MODEL}
            assert manifest["signature_info"]["common_name"] == SIGNER_NAME
            # The audio is all there, at its rate.
            with av.open(io.BytesIO(data)) as c:
                assert c.streams.audio[0].rate == rate
            got = decoded_samples(data) * 24000 / rate
            assert SAMPLES - 64 <= got < SAMPLES + (2400 if codec == "mp3" else 64), (codec, got)
            p = read_provenance(path, trust_anchors=chain.root_pem)
            assert p.present and p.valid and p.trusted and p.errors == ()
        # pcm: no container to carry a manifest; the file is the samples, as before.
        job, data = await run_job(s, h, response_format="pcm")
        assert len(data) == SAMPLES * 2 == job["audio_bytes"]


async def test_unconfigured_files_are_unsigned_and_the_start_says_so(
    layout: InstanceLayout, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = JobsConfig(dir=str(tmp_path / "jobs"), poll_s=0.05)
    with caplog.at_level(logging.INFO, logger="gateway.jobs.routes"):
        async with (
            running_gateway(layout, serve={"jobs": jobs}, api_keys=[KEY]) as h,
            aiohttp.ClientSession() as s,
        ):
            _, data = await run_job(s, h, response_format="wav")
    assert any("files are unsigned" in r.getMessage() for r in caplog.records)
    path = tmp_path / "out.wav"
    path.write_bytes(data)
    assert not read_provenance(path).present
    assert len(data) == 44 + SAMPLES * 2


def test_a_sealed_write_is_all_or_nothing(tmp_path: Path) -> None:
    """``write_atomic``'s seal (the signing step) replaces the file it was given, or, when it
    fails, leaves neither the file nor a temporary one."""

    def upper(whole: Any, out: Any) -> None:
        out.write(whole.read().upper() + b"!")

    path = tmp_path / "a.wav"
    assert write_atomic(path, iter([b"ab", b"cd"]), None, upper) == 5
    assert path.read_bytes() == b"ABCD!"

    def broken(whole: Any, out: Any) -> None:
        out.write(b"half")
        raise SigningFailed("no")

    with pytest.raises(SigningFailed):
        write_atomic(tmp_path / "b.wav", iter([b"ab"]), None, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"]
