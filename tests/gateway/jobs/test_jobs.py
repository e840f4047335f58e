"""Long-form jobs (``/v1/audio/jobs``, gateway/jobs/) against a gateway fed by the synthetic
backend (tests/harness/gateway_harness.py): the API, ownership per key, limits, cancel, the priority
rule, a full disk, corrupt jobs, and a kill -9 of the whole server in the middle of a job."""

from __future__ import annotations

import asyncio
import errno
import io
import os
import signal
import subprocess
import sys
import time
import wave
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import av
import msgspec
import numpy as np
import pytest
from gateway_harness import NO_STORE, Harness, running_gateway, wait_until

from common.config.jobs import JobsConfig
from common.config.llm import LLMConfig
from gateway.jobs.routes import split_units
from gateway.jobs.runner import JobRunner, fade_edges
from gateway.jobs.store import JobSpec, JobStore, owner_of
from shm.layout import InstanceLayout
from shm.ring import unlink_ring
from testkit.synthetic_backend import synthetic_pcm

pytestmark = pytest.mark.timeout(90)

FRAMES = 6
"""Frames of audio per unit (the jobs set max_tokens = 7 * FRAMES)."""
UNIT_BYTES = FRAMES * 2048 * 2
KEY_A, KEY_B, ADMIN = "key-a", "key-b", "admin-key"
FADE = int(JobsConfig().join_fade_ms * 24)
TEXT = " ".join(f"Sentence number {i} is here." for i in range(8))


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def job_body(text: str = TEXT, **kw: Any) -> dict[str, Any]:
    return {"input": text, "voice": "tara", "response_format": "pcm",
            "max_tokens": 7 * FRAMES, **kw}  # fmt: skip


def expected_pcm(units: int) -> bytes:
    """What an uninterrupted job speaks: every unit's tone, faded at its edges, in order."""
    unit = b"".join(synthetic_pcm(f * 2048, 2048).tobytes() for f in range(FRAMES))
    return fade_edges(unit, FADE) * units


@asynccontextmanager
async def jobs_gateway(
    layout: InstanceLayout,
    jobs_dir: Path,
    *,
    backend: dict[str, Any] | None = None,
    keys: bool = True,
    **jobs: Any,
) -> AsyncIterator[Harness]:
    gateway: dict[str, Any] = {"api_keys": [KEY_A, KEY_B], "admin_keys": [ADMIN]} if keys else {}
    gateway["max_active_streams"] = jobs.pop("max_active", 16)
    cfg = JobsConfig(dir=str(jobs_dir), poll_s=0.05, **jobs)
    async with running_gateway(layout, backend=backend, serve={"jobs": cfg}, **gateway) as h:
        yield h


async def submit(
    s: aiohttp.ClientSession, h: Harness, key: str | None = KEY_A, **kw: Any
) -> dict[str, Any]:
    async with s.post(f"{h.url}/v1/audio/jobs", json=job_body(**kw), headers=auth(key)) as r:
        assert r.status == 202, await r.text()
        assert r.headers["Location"].startswith("/v1/audio/jobs/job_")
        return await r.json()  # type: ignore[no-any-return]


async def get(s: aiohttp.ClientSession, h: Harness, job_id: str, key: str | None = KEY_A) -> Any:
    async with s.get(f"{h.url}/v1/audio/jobs/{job_id}", headers=auth(key)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def wait_state(
    s: aiohttp.ClientSession,
    h: Harness,
    job_id: str,
    states: set[str],
    timeout_s: float = 30,
    key: str | None = ADMIN,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job = await get(s, h, job_id, key)
        if job["state"] in states:
            return job  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"job stuck in {job}"
        await asyncio.sleep(0.05)


async def fetch_audio(
    s: aiohttp.ClientSession, h: Harness, job_id: str, headers: dict[str, str] | None = None
) -> tuple[int, bytes, Any]:
    async with s.get(
        f"{h.url}/v1/audio/jobs/{job_id}/audio", headers={**auth(KEY_A), **(headers or {})}
    ) as r:
        return r.status, await r.read(), r.headers


def job_submits(h: Harness) -> list[str]:
    return [m.text for m in h.backend.submitted()]


# -- the API ---------------------------------------------------------------------------------
async def test_a_job_speaks_every_unit_once_in_order(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    units = split_units(TEXT, LLMConfig().max_chars_per_segment)
    assert len(units) == 8
    async with jobs_gateway(layout, tmp_path / "jobs") as h, aiohttp.ClientSession() as s:
        job = await submit(s, h)
        assert job["state"] == "queued" and job["progress"]["units_total"] == 8
        assert job["text_chars"] == len(TEXT) and "_owner" not in job
        done = await wait_state(s, h, job["id"], {"done", "failed"})
        assert done["state"] == "done", done
        assert done["progress"]["units_done"] == 8
        assert done["progress"]["audio_seconds"] == pytest.approx(8 * FRAMES * 2048 / 24000)
        status, data, headers = await fetch_audio(s, h, job["id"])
        assert status == 200 and headers["Content-Type"] == "audio/pcm"
        assert int(headers["Content-Length"]) == len(data) == done["audio_bytes"]
        assert data == expected_pcm(8)
        assert sorted(job_submits(h)) == sorted(units)  # each unit exactly once
        units_dir = tmp_path / "jobs" / job["id"] / "units"
        await wait_until(lambda: not units_dir.exists(), what="units freed once encoded")
        assert h.metric("orpheus_gateway_job_units_total") == 8
        assert h.metric("orpheus_gateway_requests_total", {"api": "jobs", "outcome": "ok"}) == 8


async def test_encoded_file_with_range_and_a_whole_wav(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with jobs_gateway(layout, tmp_path / "jobs") as h, aiohttp.ClientSession() as s:
        mp3 = await submit(s, h, response_format="mp3")
        wav = await submit(s, h, response_format="wav", sample_rate=16000)
        for job in (mp3, wav):
            assert (await wait_state(s, h, job["id"], {"done", "failed"}))["state"] == "done"
        status, whole, headers = await fetch_audio(s, h, mp3["id"])
        assert status == 200 and headers["Content-Type"] == "audio/mpeg"
        with av.open(io.BytesIO(whole)) as c:
            samples = sum(f.samples for f in c.decode(audio=0))
        assert abs(samples - 8 * FRAMES * 2048) < 2400
        status, part, headers = await fetch_audio(s, h, mp3["id"], {"Range": "bytes=100-199"})
        assert status == 206 and part == whole[100:200]
        assert headers["Content-Length"] == "100"
        assert headers["Content-Range"] == f"bytes 100-199/{len(whole)}"
        _, data, _ = await fetch_audio(s, h, wav["id"])
        with wave.open(io.BytesIO(data)) as w:  # real sizes in the header, not streaming's
            assert w.getframerate() == 16000
            assert w.getnframes() == (len(data) - 44) // 2
        assert abs((len(data) - 44) // 2 - 8 * FRAMES * 2048 * 2 // 3) < 64


async def test_keys_own_their_jobs_and_admins_see_all(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with jobs_gateway(layout, tmp_path / "jobs") as h, aiohttp.ClientSession() as s:
        a = await submit(s, h, KEY_A)
        b = await submit(s, h, KEY_B)
        url = f"{h.url}/v1/audio/jobs"
        async with s.get(url, headers=auth(KEY_A)) as r:
            assert [j["id"] for j in (await r.json())["data"]] == [a["id"]]
        async with s.get(url, headers=auth(ADMIN)) as r:
            assert {j["id"] for j in (await r.json())["data"]} == {a["id"], b["id"]}
        for method, path in (("GET", ""), ("GET", "/audio"), ("DELETE", "")):
            async with s.request(method, f"{url}/{a['id']}{path}", headers=auth(KEY_B)) as r:
                assert r.status == 404, (method, path)
                assert (await r.json())["error"]["code"] == "job_not_found"
        async with s.get(url, headers=auth(None)) as r:
            assert r.status == 401
        async with s.get(f"{url}/job_{'0' * 24}", headers=auth(KEY_A)) as r:
            assert r.status == 404
        async with s.get(f"{url}/..%2F..%2Fetc", headers=auth(KEY_A)) as r:
            assert r.status == 404
        await wait_state(s, h, a["id"], {"done"})
        async with s.delete(f"{url}/{a['id']}", headers=auth(ADMIN)) as r:
            assert r.status == 200 and (await r.json())["deleted"] is True
        async with s.get(f"{url}/{a['id']}", headers=auth(KEY_A)) as r:
            assert r.status == 404
        assert not (tmp_path / "jobs" / a["id"]).exists()


async def test_limits(layout: InstanceLayout, tmp_path: Path) -> None:
    async with (
        jobs_gateway(layout, tmp_path / "jobs", max_text_chars=500, max_jobs_per_key=2) as h,
        aiohttp.ClientSession() as s,
    ):
        url = f"{h.url}/v1/audio/jobs"
        async with s.post(url, json=job_body("word " * 101), headers=auth(KEY_A)) as r:
            assert r.status == 413
            err = (await r.json())["error"]
            assert err["code"] == "text_too_long" and "500" in err["message"]
        long_text = "A sentence of a book. " * 300  # far above gateway.max_input_chars
        async with s.post(url, json=job_body(long_text[:500]), headers=auth(KEY_A)) as r:
            assert r.status == 202
        for body, code in (
            ({**job_body(), "voice": "nobody"}, "bad_request"),
            ({**job_body(), "speling": 1}, "invalid_request"),
            (job_body("   "), "empty_input"),
        ):
            async with s.post(url, json=body, headers=auth(KEY_A)) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == code, body
        await submit(s, h, KEY_A)
        async with s.post(url, json=job_body(), headers=auth(KEY_A)) as r:
            assert r.status == 429 and (await r.json())["error"]["code"] == "job_quota_exceeded"
        await submit(s, h, KEY_B)  # the quota is per key


async def test_default_limit_takes_a_long_text(layout: InstanceLayout, tmp_path: Path) -> None:
    """A 200,000-character text (50 times the interactive cap) is one job; the default
    limit is 1,000,000 characters."""
    assert JobsConfig().max_text_chars == 1_000_000
    text = "This is one sentence of a long chapter. " * 5000
    async with jobs_gateway(layout, tmp_path / "jobs") as h, aiohttp.ClientSession() as s:
        job = await submit(s, h, input=text)
        assert job["progress"]["units_total"] == 5000
        async with s.delete(f"{h.url}/v1/audio/jobs/{job['id']}", headers=auth(KEY_A)) as r:
            assert r.status == 200


async def test_cancel_frees_the_engine_and_delete_removes(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        jobs_gateway(layout, tmp_path / "jobs", backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        job = await submit(s, h)
        await wait_until(lambda: len(h.gateway.requests) > 0, what="a unit in flight")
        url = f"{h.url}/v1/audio/jobs/{job['id']}"
        async with s.delete(url, headers=auth(KEY_A)) as r:
            assert r.status == 200 and (await r.json())["state"] == "cancelled"
        await wait_until(lambda: len(h.backend.cancelled_ids()) > 0, what="LlmCancel")
        await wait_until(lambda: len(h.gateway.requests) == 0, what="units ended")
        deadline = time.monotonic() + 10
        while (done := await get(s, h, job["id"]))["finished_at"] is None:  # the runner's last word
            assert done["state"] == "cancelled" and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert done["state"] == "cancelled"
        status, data, _ = await fetch_audio(s, h, job["id"])
        assert status == 409 and b"job_cancelled" in data
        n = len(h.backend.submitted())
        await asyncio.sleep(0.3)
        assert len(h.backend.submitted()) == n  # no unit more
        async with s.delete(url, headers=auth(KEY_A)) as r:
            assert r.status == 200 and (await r.json())["deleted"]
        async with s.get(url, headers=auth(KEY_A)) as r:
            assert r.status == 404


async def test_partial_pcm_while_running(layout: InstanceLayout, tmp_path: Path) -> None:
    async with (
        jobs_gateway(layout, tmp_path / "jobs", backend={"realtime": True}, streams_per_job=1) as h,
        aiohttp.ClientSession() as s,
    ):
        job = await submit(s, h)
        deadline = time.monotonic() + 20
        while (await get(s, h, job["id"]))["progress"]["units_done"] < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        status, data, headers = await fetch_audio(s, h, job["id"])
        assert status == 200 and headers["X-Job-State"] == "running"
        units = len(data) // UNIT_BYTES
        assert units >= 2 and data == expected_pcm(units)
        assert int(headers["Content-Length"]) == len(data)
        mp3 = await submit(s, h, response_format="mp3")
        status, data, _ = await fetch_audio(s, h, mp3["id"])
        assert status == 409 and b"job_not_done" in data


# -- priority ---------------------------------------------------------------------------------
async def test_units_leave_the_reserve_to_interactive_requests(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """max_active 4, reserve 2: jobs hold at most 2 streams; while interactive requests hold
    2 or more, no unit starts; once they end, the job goes on."""
    async with (
        jobs_gateway(
            layout, tmp_path / "jobs", backend={"realtime": True},
            max_active=4, reserve_streams=2, streams_per_job=4, max_running_jobs=2,
        ) as h,
        aiohttp.ClientSession() as s,
    ):  # fmt: skip
        most = 0

        def job_streams() -> int:
            return int(h.metric("orpheus_gateway_job_streams"))

        async def sample() -> None:
            nonlocal most
            while True:
                most = max(most, job_streams())
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        jobs = [await submit(s, h), await submit(s, h, KEY_B)]
        await wait_until(lambda: job_streams() == 2, what="units at the limit")
        body = {"model": "tts-1", "input": "Hello.", "voice": "tara", "max_tokens": 7 * 30}
        speech = f"{h.url}/v1/audio/speech"

        async def interactive() -> int:
            # no-store: two twins would otherwise share one synthesis (single flight)
            async with s.post(speech, json=body, headers={**auth(KEY_A), **NO_STORE}) as r:
                await r.read()
                return r.status

        calls = [asyncio.create_task(interactive()) for _ in range(2)]
        # The units running finish; no new one starts while the interactive two hold the limit.
        await wait_until(lambda: job_streams() == 0, timeout_s=10, what="units yield")
        started = len(h.backend.submitted())
        await asyncio.sleep(1.0)
        assert len(h.backend.submitted()) == started, "a unit started inside the reserve"
        assert await asyncio.gather(*calls) == [200, 200]
        for job in jobs:
            assert (await wait_state(s, h, job["id"], {"done", "failed"}))["state"] == "done"
        sampler.cancel()
        assert most == 2


# -- failures --------------------------------------------------------------------------------
async def test_a_full_disk_fails_that_job_only(
    layout: InstanceLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed: set[str] = set()
    write_unit = JobStore.write_unit

    def full_for_doomed(self: JobStore, job_id: str, index: int, pcm: bytes) -> int:
        if job_id in doomed and index == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_unit(self, job_id, index, pcm)

    monkeypatch.setattr(JobStore, "write_unit", full_for_doomed)
    async with jobs_gateway(layout, tmp_path / "jobs") as h, aiohttp.ClientSession() as s:
        bad = await submit(s, h, response_format="mp3")
        doomed.add(bad["id"])
        good = await submit(s, h, KEY_B)
        failed = await wait_state(s, h, bad["id"], {"done", "failed"})
        assert failed["state"] == "failed"
        assert failed["reason"] == (
            "unit 4 could not be written: the jobs' disk is full (No space left on device)"
        )
        assert (await wait_state(s, h, good["id"], {"done", "failed"}))["state"] == "done"
        async with s.get(f"{h.url}/ready") as r:
            assert r.status == 200


def _stored_job(store: JobStore, job_id: str, units: int, owner: str = owner_of(KEY_A)) -> None:
    store.create(
        JobSpec(
            id=job_id, owner=owner, created_at=time.time(), voice="tara",
            response_format="pcm", sample_rate=24000, text_chars=10 * units,
            units=[f"Unit {i}." for i in range(units)],
        )
    )  # fmt: skip


async def test_corrupt_job_and_unreadable_unit_fail_that_job(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    store = JobStore(tmp_path / "jobs")
    corrupt, unreadable = "job_" + "1" * 24, "job_" + "2" * 24
    _stored_job(store, corrupt, 3)
    (store.path(corrupt) / "job.json").write_bytes(b'{"id": "job_1111')
    _stored_job(store, unreadable, 3)
    for i in (0, 2):
        store.write_unit(unreadable, i, b"\0\0" * 100)
    store.unit_path(unreadable, 1).mkdir()  # a unit that is there and cannot be read
    async with jobs_gateway(layout, tmp_path / "jobs") as h, aiohttp.ClientSession() as s:
        good = await submit(s, h)
        bad = await wait_state(s, h, unreadable, {"done", "failed"})
        assert bad["state"] == "failed"
        assert bad["reason"].startswith("unit 2 cannot be read: IsADirectoryError")
        view = await get(s, h, corrupt)  # still its owner's, through its owner file
        assert view["state"] == "failed"
        assert view["reason"].startswith("corrupt job directory: job.json cannot be read")
        assert (await wait_state(s, h, good["id"], {"done", "failed"}))["state"] == "done"
        async with s.delete(f"{h.url}/v1/audio/jobs/{corrupt}", headers=auth(KEY_A)) as r:
            assert r.status == 200
        assert not store.path(corrupt).exists()


async def test_finished_jobs_expire(
    layout: InstanceLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gateway.jobs.runner.SWEEP_PERIOD_S", 0.1)
    async with (
        jobs_gateway(layout, tmp_path / "jobs", expire_after_s=0.5) as h,
        aiohttp.ClientSession() as s,
    ):
        job = await submit(s, h)
        await wait_state(s, h, job["id"], {"done"})
        await wait_until(
            lambda: not (tmp_path / "jobs" / job["id"]).exists(), timeout_s=5, what="expiry"
        )
        await wait_until(
            lambda: h.metric("orpheus_gateway_jobs", {"state": "done"}) == 0, what="the gauge"
        )


async def test_the_runner_closes_when_a_wake_meets_its_cancel(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """A job created just before shutdown wakes the runner's loop as ``close`` cancels it.
    On Python 3.11, ``asyncio.wait_for`` returns the event's result and drops a cancellation
    that arrives in that step, and the loop ran on: ``close`` waited for ever (CI of stop 52,
    ``test_limits``). Each number of loop steps between the wake and the cancel is tried."""
    async with jobs_gateway(layout, tmp_path / "jobs") as h:
        for steps in range(4):
            runner = JobRunner(h.gateway, JobsConfig(poll_s=30), JobStore(tmp_path / "own"))
            runner.start()
            await asyncio.sleep(0.05)  # the loop's first pass is over: it waits for a wake
            runner.wake()
            for _ in range(steps):
                await asyncio.sleep(0)
            async with asyncio.timeout(5):
                await runner.close()


# -- kill -9 ------------------------------------------------------------------------------------
CHILD = """
import asyncio, sys, msgspec
sys.path.insert(0, "tests/harness")
from gateway_harness import running_gateway
from common.config.jobs import JobsConfig
from shm.layout import InstanceLayout

async def main():
    layout = msgspec.json.decode(sys.argv[1].encode(), type=InstanceLayout)
    jobs = JobsConfig(dir=sys.argv[2], poll_s=0.05, streams_per_job=2)
    async with running_gateway(layout, backend={"realtime": True}, serve={"jobs": jobs}) as h:
        print(h.port, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_kill_9_of_the_whole_server_resumes_every_unit_once(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """The server (gateway and its synthetic workers, one process) is killed with SIGKILL in
    the middle of a job; a new one resumes it: the file is what an uninterrupted run makes."""
    jobs_dir = tmp_path / "jobs"
    text = " ".join(f"Line {i} of the chapter." for i in range(12))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, msgspec.json.encode(layout).decode(), str(jobs_dir)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        url = f"http://127.0.0.1:{port}/v1/audio/jobs"
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=job_body(text)) as r:
                assert r.status == 202
                job_id = (await r.json())["id"]
            while True:
                async with s.get(f"{url}/{job_id}") as r:
                    if (await r.json())["progress"]["units_done"] >= 4:
                        break
                await asyncio.sleep(0.02)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    store = JobStore(jobs_dir)
    assert store.state(job_id).state == "running"
    before = store.done_units(job_id)
    assert 4 <= len(before) < 12
    unlink_ring(layout.pcm_ring(0))  # what the killed server left
    async with jobs_gateway(layout, jobs_dir, keys=False) as h, aiohttp.ClientSession() as s:
        done = await wait_state(s, h, job_id, {"done", "failed"}, key=None)
        assert done["state"] == "done"
        spoken = job_submits(h)
        assert sorted(spoken) == sorted(
            split_units(text, 280)[i] for i in range(12) if i not in before
        )
        async with s.get(f"{h.url}/v1/audio/jobs/{job_id}/audio") as r:
            data = await r.read()
        assert data == expected_pcm(12)
    assert np.frombuffer(data, "<i2").size == 12 * FRAMES * 2048


# -- orpheus-serve say --file ----------------------------------------------------------------
async def _say(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orpheus_serve", "say", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


async def test_say_file_writes_the_whole_file(layout: InstanceLayout, tmp_path: Path) -> None:
    chapter = tmp_path / "chapter.txt"
    chapter.write_text(TEXT)
    out = tmp_path / "chapter.wav"
    async with jobs_gateway(layout, tmp_path / "jobs") as h:
        code, log = await _say(
            "--file", str(chapter), "-o", str(out), "--url", h.url, "--api-key", KEY_A,
            "--max-tokens", str(7 * FRAMES),
        )  # fmt: skip
        assert code == 0, log
        assert "8/8 units" in log and f"wrote {out}" in log
        with wave.open(str(out)) as w:
            assert w.readframes(w.getnframes()) == expected_pcm(8)
        code, log = await _say(
            "--file", str(chapter), "-o", str(tmp_path / "x.txt"), "--url", h.url
        )
        assert code == 1 and "cannot tell the format" in log


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def test_say_file_survives_ctrl_c_and_resumes(layout: InstanceLayout, tmp_path: Path) -> None:
    chapter = tmp_path / "chapter.txt"
    chapter.write_text(TEXT)
    out = tmp_path / "chapter.pcm"
    async with jobs_gateway(layout, tmp_path / "jobs", backend={"realtime": True}) as h:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orpheus_serve", "say", "--file", str(chapter), "-o", str(out),
            "--url", h.url, "--api-key", KEY_A, "--max-tokens", str(7 * FRAMES),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            # A terminal's Ctrl-C: where the suite itself runs as a background job of a shell
            # without job control, SIGINT is ignored and every child would inherit that.
            preexec_fn=_sigint_default,
        )  # fmt: skip
        assert proc.stdout is not None
        first = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert first.startswith("job job_"), first
        job_id = first.split()[1].rstrip(":")
        proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 130, rest
        assert f"--resume {job_id}" in rest.decode()
        assert not out.exists()
        code, log = await _say(
            "--resume", job_id, "-o", str(out), "--url", h.url, "--api-key", KEY_A
        )
        assert code == 0, log
        assert out.read_bytes() == expected_pcm(8)
        assert len(h.backend.submitted()) == 8  # the job went on alone; nothing was spoken twice


# -- several gateway processes --------------------------------------------------------------
async def test_two_gateways_on_one_jobs_dir_run_each_job_once(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """Two gateways (each with its own workers) share the jobs directory: each job is run by
    exactly one of them (its lock), and either answers for any job."""
    other = InstanceLayout(instance=layout.instance + "b", run_dir=layout.run_dir)
    os.makedirs(other.socket_dir)
    jobs_dir = tmp_path / "jobs"
    try:
        async with (
            jobs_gateway(layout, jobs_dir, backend={"realtime": True}) as h1,
            jobs_gateway(other, jobs_dir, backend={"realtime": True}) as h2,
            aiohttp.ClientSession() as s,
        ):
            # Each job its own text: a unit its key has had synthesised twice would be answered
            # by the sentence audio cache, not spoken (counted below).
            texts = [TEXT.replace("Sentence", f"Job {i} sentence") for i in range(4)]
            ids = [
                (await submit(s, h1 if i % 2 else h2, text=t))["id"] for i, t in enumerate(texts)
            ]
            for job_id in ids:
                assert (await wait_state(s, h1, job_id, {"done", "failed"}))["state"] == "done"
                assert (await get(s, h2, job_id))["state"] == "done"
            spoken = job_submits(h1) + job_submits(h2)
            assert sorted(spoken) == sorted(u for t in texts for u in split_units(t, 280))
            assert job_submits(h1) and job_submits(h2)  # both took some
    finally:
        from shm.segments import destroy_instance

        destroy_instance(other)


# -- unit failures and quotas ------------------------------------------------------------------
async def test_units_the_workers_fail_are_retried_then_fail_the_job(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """A unit the workers fail once (a 500) is spoken again and the job is whole; a unit they
    refuse (a 400) fails its job at once with the reason."""
    from gateway.voices.catalogue import ENGLISH_VOICES
    from shm.messages import LlmSubmit
    from shm.records import StreamError
    from testkit.synthetic_backend import StreamPlan, default_plan

    failed_once: set[str] = set()

    def plan(submit: LlmSubmit) -> StreamPlan:
        if submit.text.startswith("Flaky") and submit.text not in failed_once:
            failed_once.add(submit.text)
            return StreamPlan(
                frames=4, error=StreamError("engine_error", "boom", 500), error_after=1
            )
        if submit.text.startswith("Refused"):
            return StreamPlan(frames=0, error=StreamError("bad_request", "cannot say it", 400))
        return default_plan(ENGLISH_VOICES)(submit)

    async with (
        jobs_gateway(layout, tmp_path / "jobs", backend={"plan": plan}) as h,
        aiohttp.ClientSession() as s,
    ):
        flaky = await submit(s, h, input="One here. Flaky two. Three here.")
        refused = await submit(s, h, KEY_B, input="One there. Refused two. Three there.")
        assert (await wait_state(s, h, flaky["id"], {"done", "failed"}))["state"] == "done"
        _, data, _ = await fetch_audio(s, h, flaky["id"])
        assert data == expected_pcm(3)
        bad = await wait_state(s, h, refused["id"], {"done", "failed"})
        assert bad["state"] == "failed"
        assert bad["reason"] == "unit 2: cannot say it (bad_request)"
        assert job_submits(h).count("Refused two.") == 1


async def test_the_byte_quota_fails_the_job_that_passes_it(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        jobs_gateway(layout, tmp_path / "jobs", max_bytes_per_key=3 * UNIT_BYTES) as h,
        aiohttp.ClientSession() as s,
    ):
        job = await submit(s, h)
        failed = await wait_state(s, h, job["id"], {"done", "failed"})
        assert failed["state"] == "failed"
        assert failed["reason"].startswith("quota_exceeded: this key's jobs would take more than")
        other = await submit(s, h, KEY_B, input="Short one.")  # another key is not affected
        assert (await wait_state(s, h, other["id"], {"done", "failed"}))["state"] == "done"


async def test_a_job_whose_state_cannot_be_written_is_not_retried_in_a_loop(
    layout: InstanceLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk refuses even the job's state: the job stays as it was on disk, nothing is
    spoken, and the process does not take it up again at every pass."""
    tries: list[str] = []
    doomed: set[str] = set()
    write_state = JobStore.write_state

    def refuse(self: JobStore, job_id: str, state: Any) -> None:
        if job_id in doomed:
            tries.append(state.state)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_state(self, job_id, state)

    monkeypatch.setattr(JobStore, "write_state", refuse)
    store = JobStore(tmp_path / "jobs")
    stuck = "job_" + "3" * 24
    _stored_job(store, stuck, 3)
    doomed.add(stuck)
    async with jobs_gateway(layout, tmp_path / "jobs") as h, aiohttp.ClientSession() as s:
        await wait_until(lambda: len(tries) >= 2, what="the running and failed writes")
        good = await submit(s, h)
        assert (await wait_state(s, h, good["id"], {"done", "failed"}))["state"] == "done"
        await asyncio.sleep(0.5)  # ten passes
        assert tries == ["running", "failed"]
        assert (await get(s, h, stuck))["state"] == "queued"
        assert all(not t.startswith("Unit") for t in job_submits(h))
