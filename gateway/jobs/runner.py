"""Running jobs: each gateway process runs the jobs it claims, unit by unit.

A pass every ``jobs.poll_s`` (or at once when this process creates a job) looks for jobs
that are queued, or running with nobody holding their lock (their process died), and claims
the oldest with the job's ``flock`` (``store.JobLock``): exactly one process of the node runs a
job, and a job left by a process killed with -9 is taken over by the next pass of any
process. A claimed job speaks the units that have no file yet, at most
``jobs.streams_per_job`` at once, each as one request through ``Gateway.requests`` (the same
admission, placement, metrics and log line as an interactive request, ``api="jobs"``).

Priority: a unit is admitted only while the node has fewer than its capacity (what its
ready engines hold: the learned limit, or ``max_active_streams``) less
``jobs.reserve_streams`` (learned: at most half the capacity) active streams and no
interactive request waits (``has_room``); one
unit at a time passes that check and is admitted (the gate lock), so the units of several
jobs never overshoot it together. A unit already running is not stopped.

A unit's audio is faded in and out (``jobs.join_fade_ms``) and written whole
(``JobStore.write_unit``); when every unit is there the file is encoded once
(``gateway.audio.output.make_output``, the format and speed of the job), a WAV or MP3
file signed with a C2PA manifest where the operator configured a certificate
(``common.provenance``), and the units are removed. A unit the workers fail is tried again (``jobs.unit_retries``); a refusal (the
node busy, not ready, draining) only waits. A full disk, an unreadable unit or a corrupt
directory fails that job with the reason; the other jobs and the server go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, TypeVar

import numpy as np

from common.aio import wait_event
from common.config.jobs import JobsConfig
from common.provenance.manifest import SIGNED_MIME
from common.provenance.signing import FileSigner, SigningFailed
from gateway.admission.readiness import background_room
from gateway.apis import Api
from gateway.audio.formats import OutputFormat
from gateway.audio.output import make_output
from gateway.cache.keys import job_tenant
from gateway.errors import APIError
from gateway.jobs.store import (
    BYTES_PER_SECOND,
    FINISHED,
    CorruptJob,
    JobLock,
    JobSpec,
    JobState,
    JobStore,
    NodeGate,
    describe_os_error,
    write_atomic,
)
from gateway.requests import ActiveRequest
from gateway.schemas import SpeechParams
from gateway.service import Gateway
from gateway.streams import StreamFailed
from shm.records import SAMPLE_RATE, StreamError

log = logging.getLogger(__name__)

T = TypeVar("T")
SWEEP_PERIOD_S = 10.0
"""How often expired jobs are deleted and the jobs' gauges (by state, disk) refreshed."""
ROOM_POLL_S = 0.02
"""How often a unit waiting for spare capacity looks again."""
IO_THREADS = 4
UNRECORDED_BACKOFF_S = 60.0
"""A job whose end could not be written (a full disk) waits this long before this process
takes it up again, instead of failing again at every pass."""
CANCELLED = StreamError("cancelled", "the job was cancelled", 499)
NOT_COUNTED = frozenset({"shutdown", "cancelled", "client_disconnected"})
"""Stream errors that say nothing about the unit: it waits and is spoken again."""


class JobFailed(Exception):
    """The job cannot go on; the message is its ``reason``."""


def fade_edges(pcm: bytes, samples: int) -> bytes:
    """``pcm`` (s16le) faded in and out over ``samples`` each (a raised-cosine ramp), so that
    units join without a click whatever sample they start and end on."""
    x = np.frombuffer(pcm, dtype="<i2")
    n = min(samples, x.size // 2)
    if n <= 0:
        return pcm
    y = x.astype(np.float32)
    ramp = (0.5 - 0.5 * np.cos(np.pi * (np.arange(n, dtype=np.float32) + 0.5) / n)).astype(
        np.float32
    )
    y[:n] *= ramp
    y[-n:] *= ramp[::-1]
    return np.round(y).astype("<i2").tobytes()


def _wav_sizes(f: BinaryIO, size: int) -> None:
    """Write the real RIFF and data sizes into a whole WAV file's 44-byte header."""
    f.seek(4)
    f.write((size - 8).to_bytes(4, "little"))
    f.seek(40)
    f.write((size - 44).to_bytes(4, "little"))
    f.seek(0, 2)


class RunningJob:
    """A job this process runs: its spec, its lock, its units in flight."""

    def __init__(self, spec: JobSpec, lock: JobLock) -> None:
        self.spec = spec
        self.lock = lock
        self.active: set[ActiveRequest] = set()
        self.stop_event = asyncio.Event()
        self.cancelled = False
        self.failure: str | None = None
        self.bytes_used = 0
        self.other_bytes = 0
        """Disk the owner's other jobs took when this one was claimed (the quota)."""
        self.task: asyncio.Task[None] | None = None

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def stop(self, *, failure: str | None = None, cancelled: bool = False) -> None:
        """Start no unit more and end the ones running now (their streams freed upstream)."""
        if failure is not None and self.failure is None and not self.cancelled:
            self.failure = failure
        self.cancelled |= cancelled
        self.stop_event.set()
        for request in list(self.active):
            request.fail(CANCELLED)

    def params(self, index: int) -> SpeechParams:
        s = self.spec
        return SpeechParams(
            text=s.units[index],
            voice=s.voice,
            sampling=s.sampling,
            response_format="pcm",
            sample_rate=SAMPLE_RATE,
            speed=1.0,
        )


class JobRunner:
    """Runs this gateway process's share of the node's jobs (see the module docstring)."""

    def __init__(
        self,
        gateway: Gateway,
        config: JobsConfig,
        store: JobStore,
        signer: FileSigner | None = None,
    ) -> None:
        self.gateway = gateway
        self.config = config
        self.store = store
        self.signer = signer
        """Signs a C2PA manifest into each WAV and MP3 file (None: files are unsigned)."""
        self.metrics = gateway.metrics
        self.running: dict[str, RunningJob] = {}
        self._gate = asyncio.Lock()
        self._node_gate = NodeGate(store.root)
        self._executor = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="jobs-io")
        """The runner's blocking disk work (fsync'd writes, encoding the file): its own threads,
        so that a slow disk never holds up the API's reads or other users of the default
        executor."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._last_sweep = 0.0
        self._fade = int(config.join_fade_ms * SAMPLE_RATE / 1000)
        self._pass_error_at = -UNRECORDED_BACKOFF_S
        self._backoff: dict[str, float] = {}
        """Jobs not to take up again before a time (``UNRECORDED_BACKOFF_S``)."""

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="jobs-runner")

    async def close(self) -> None:
        """Stop running jobs (their state stays ``running`` on disk: the next process to
        start resumes them from their last written unit)."""
        self._closing = True
        tasks = [t for t in (self._task, *(j.task for j in self.running.values())) if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in list(self.running.values()):
            job.lock.release()
        self.running.clear()
        self._node_gate.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def wake(self) -> None:
        """A job was created: look for work now rather than at the next poll."""
        self._wake.set()

    def cancel_local(self, job_id: str) -> bool:
        """Cancel a job if this process runs it (its units' streams end now)."""
        job = self.running.get(job_id)
        if job is None:
            return False
        job.stop(cancelled=True)
        return True

    async def _io(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- priority ------------------------------------------------------------------------------
    def has_room(self) -> bool:
        """A unit may start: the node has a stream slot beyond the interactive reserve and no
        request waits for one."""
        room, reserve_in_use = background_room(
            self.gateway.admission, self.config.reserve_streams, self.gateway.draining
        )
        self.metrics.job_reserve_in_use.set(reserve_in_use)
        return room

    @contextlib.asynccontextmanager
    async def _node_turn(self, job: RunningJob) -> AsyncIterator[None]:
        """Hold the node's gate (``NodeGate``) for the block; a disk that refuses the lock
        file leaves the process's own gate only."""
        held = False
        try:
            while not job.stopping:
                try:
                    held = self._node_gate.try_acquire()
                except OSError as e:
                    log.warning("jobs: no node-wide admission lock (%s); this process's only", e)
                    break
                if held:
                    break
                await self._pause(job, ROOM_POLL_S)
            yield
        finally:
            if held:
                self._node_gate.release()

    async def _wait_for_room(self, job: RunningJob) -> None:
        while not job.stopping and not self.has_room():
            await self._pause(job, ROOM_POLL_S)

    # -- the claim loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        while not self._closing:
            try:
                await self._pass()
            except Exception:
                if time.monotonic() - self._pass_error_at > UNRECORDED_BACKOFF_S:
                    self._pass_error_at = time.monotonic()
                    log.exception(
                        "jobs: a pass over %s failed; trying again every %g s (logged once a "
                        "minute)", self.store.root, self.config.poll_s,
                    )  # fmt: skip
            await wait_event(self._wake, self.config.poll_s)
            self._wake.clear()

    async def _pass(self) -> None:
        now = time.time()
        for job_id, job in list(self.running.items()):
            if not job.stopping and await self._io(self.store.cancelled, job_id):
                job.stop(cancelled=True)
        if now - self._last_sweep >= SWEEP_PERIOD_S:
            self._last_sweep = now
            await self._io(self._sweep, now)
        room = self.config.max_running_jobs - len(self.running)
        if self.gateway.draining or room <= 0:
            return
        now = time.monotonic()
        self._backoff = {k: t for k, t in self._backoff.items() if t > now}
        skip = frozenset(self.running) | frozenset(self._backoff)
        for spec, lock in await self._io(self._claim, room, skip):
            job = RunningJob(spec, lock)
            self.running[spec.id] = job
            job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"job-{spec.id}")

    def _claim(self, room: int, skip: frozenset[str]) -> list[tuple[JobSpec, JobLock]]:
        """Up to ``room`` jobs to run, oldest first (by their ``job.json``, written once):
        queued, or running with no live process; each with its lock taken."""
        candidates: list[tuple[float, str]] = []
        for job_id in self.store.ids():
            if job_id in skip:
                continue
            try:
                if self.store.state(job_id).state in FINISHED:
                    continue
                created = (self.store.path(job_id) / "job.json").stat().st_mtime
            except (CorruptJob, KeyError, OSError):
                continue  # shown as failed by the API; nothing to run
            candidates.append((created, job_id))
        out: list[tuple[JobSpec, JobLock]] = []
        for _, job_id in sorted(candidates):
            if len(out) >= room:
                break
            lock = JobLock.try_take(self.store.path(job_id))
            if lock is None:
                continue  # another process runs it
            try:
                out.append((self.store.spec(job_id), lock))
            except (CorruptJob, KeyError) as e:
                self._fail_corrupt(job_id, str(e))
                lock.release()
        return out

    def _fail_corrupt(self, job_id: str, why: str) -> None:
        """A job whose ``job.json`` cannot be read: its state says so (when it can be written)."""
        try:
            state = self.store.state(job_id)
        except (CorruptJob, KeyError):
            state = JobState()
        if state.state in FINISHED:
            return
        state.state = "failed"
        state.reason = f"corrupt job directory: {why}"
        state.finished_at = time.time()
        try:
            self.store.write_state(job_id, state)
            log.warning("jobs: %s failed: %s", job_id, state.reason)
        except OSError as e:
            log.warning(
                "jobs: %s is corrupt (%s) and its state cannot be written: %s", job_id, why, e
            )

    def _sweep(self, now: float) -> None:
        """Delete expired jobs; refresh the gauges of jobs by state and disk used."""
        self.store.clean_trash()
        counts = dict.fromkeys(("queued", "running", "done", "failed", "cancelled"), 0)
        for job_id in self.store.ids():
            try:
                view = self.store.view(job_id, now)
            except KeyError:
                continue  # deleted meanwhile
            counts[view.state] += 1
            finished = view.finished_at
            if finished is None and view.reason and view.reason.startswith("corrupt"):
                with contextlib.suppress(OSError):
                    finished = self.store.path(job_id).stat().st_mtime
            if view.state in FINISHED and finished is not None:
                if now - finished > self.config.expire_after_s:
                    lock = JobLock.try_take(self.store.path(job_id))
                    if lock is not None:
                        try:
                            self.store.remove(job_id)
                            counts[view.state] -= 1
                            log.info("jobs: %s expired and was deleted", job_id)
                        except OSError as e:
                            log.warning("jobs: cannot delete expired %s: %s", job_id, e)
                        finally:
                            lock.release()
        for state, n in counts.items():
            self.metrics.jobs.labels(state).set(n)
        self.metrics.jobs_disk_bytes.set(self.store.disk_used())

    # -- one job -------------------------------------------------------------------------------
    async def _run(self, job: RunningJob) -> None:
        job_id = job.spec.id
        try:
            await self._execute(job)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("jobs: %s failed unexpectedly", job_id)
            await self._finish(job, "failed", f"internal error: {e!r}")
        finally:
            if not self._closing:
                job.lock.release()
                self.running.pop(job_id, None)
                self._wake.set()

    async def _execute(self, job: RunningJob) -> None:
        spec = job.spec
        job_id = spec.id
        try:
            state = await self._io(self.store.state, job_id)
            spec = job.spec = await self._io(self.store.spec, job_id)
        except CorruptJob as e:
            await self._finish(job, "failed", f"corrupt job directory: {e}")
            return
        if state.state in FINISHED:
            return  # finished by another process between the listing and the lock
        if await self._io(self.store.cancelled, job_id):
            await self._finish(job, "cancelled", None)
            return
        done = await self._io(self.store.done_units, job_id)
        job.bytes_used = sum(done.values())
        job.other_bytes = await self._io(self._owner_bytes, spec)
        now = time.time()
        state.state = "running"
        state.started_at = state.started_at or now
        state.run_started_at = now
        state.units_at_run_start = len(done)
        try:
            await self._io(self.store.write_state, job_id, state)
        except OSError as e:
            await self._finish(job, "failed", describe_os_error(e))
            return
        log.info(
            "jobs: running %s: %d of %d units done, %d to speak",
            job_id, len(done), len(spec.units), len(spec.units) - len(done),
        )  # fmt: skip
        slots = asyncio.Semaphore(self.config.streams_per_job)
        units: list[asyncio.Task[None]] = []
        try:
            for index in range(len(spec.units)):
                if index in done:
                    continue
                await slots.acquire()
                if job.stopping:
                    slots.release()
                    break
                task = asyncio.get_running_loop().create_task(self._unit(job, index))
                task.add_done_callback(lambda _: slots.release())
                units.append(task)
            await asyncio.gather(*units, return_exceptions=True)
        finally:
            for t in units:
                t.cancel()
        if job.cancelled:
            await self._finish(job, "cancelled", None)
        elif job.failure is not None:
            await self._finish(job, "failed", job.failure)
        else:
            await self._finalize(job, state)

    def _owner_bytes(self, spec: JobSpec) -> int:
        total = 0
        for other in self.store.ids():
            if other == spec.id:
                continue
            with contextlib.suppress(CorruptJob, KeyError):
                if self.store.spec(other).owner == spec.owner:
                    total += self.store.disk_used(other)
        return total

    async def _unit(self, job: RunningJob, index: int) -> None:
        """Speak unit ``index`` and write it, or stop the job with why it failed."""
        attempts = 0
        while not job.stopping:
            try:
                pcm = await self._speak(job, index)
            except StreamFailed as e:
                if job.stopping or e.error.code in NOT_COUNTED:
                    await self._pause(job, 1.0)
                    continue
                permanent = 400 <= e.error.status < 500 and e.error.status not in (408, 429)
                attempts += 1
                if permanent or attempts > self.config.unit_retries:
                    job.stop(failure=f"unit {index + 1}: {e.error.message} ({e.error.code})")
                    return
                log.warning(
                    "jobs: %s unit %d failed (%s), try %d of %d", job.spec.id, index + 1,
                    e.error.message, attempts + 1, self.config.unit_retries + 1,
                )  # fmt: skip
                await self._pause(job, min(0.5 * 2**attempts, 5.0))
                continue
            except APIError as e:  # refused at admission (busy, not ready, draining): wait
                await self._pause(job, float(e.retry_after_s or 1))
                continue
            if pcm is None:
                return  # stopped while speaking
            await self._write_unit(job, index, pcm)
            return

    async def _pause(self, job: RunningJob, seconds: float) -> None:
        await wait_event(job.stop_event, seconds)

    async def _speak(self, job: RunningJob, index: int) -> bytes | None:
        async with contextlib.AsyncExitStack() as stack:
            async with self._gate, self._node_turn(job):
                # One unit of the node at a time checks for room and is admitted.
                await self._wait_for_room(job)
                if job.stopping:
                    return None
                # The unit's audio goes to its buffer, then to disk: its link has no
                # connection to tear down, and counts its bytes as a client's.
                link = stack.enter_context(self.gateway.links.open(Api.JOBS))
                request = await stack.enter_async_context(
                    self.gateway.requests.open(
                        job.params(index), link, cache_tenant=job_tenant(job.spec.owner)
                    )
                )
            job.active.add(request)
            if job.stopping:  # cancelled while it waited for its slot
                request.fail(CANCELLED)
            self.metrics.job_streams.inc()
            try:
                pcm = bytearray()
                stream = request.stream
                while chunks := await stream.next_chunks():
                    n = 0
                    for chunk in chunks:
                        pcm += chunk
                        n += len(chunk)
                    link.wrote(n, request)
                request.complete()
                return bytes(pcm)
            finally:
                job.active.discard(request)
                self.metrics.job_streams.dec()
        return None  # pragma: no cover (the stack re-raises or the block returned)

    async def _write_unit(self, job: RunningJob, index: int, pcm: bytes) -> None:
        data = fade_edges(pcm, self._fade)
        if job.other_bytes + job.bytes_used + len(data) > self.config.max_bytes_per_key:
            job.stop(
                failure=f"quota_exceeded: this key's jobs would take more than "
                f"{self.config.max_bytes_per_key} bytes (jobs.max_bytes_per_key)"
            )
            return
        try:
            await self._io(self.store.write_unit, job.spec.id, index, data)
        except OSError as e:
            job.stop(failure=f"unit {index + 1} could not be written: {describe_os_error(e)}")
            return
        job.bytes_used += len(data)
        self.metrics.job_units.inc()
        self.metrics.job_audio_seconds.inc(len(data) / BYTES_PER_SECOND)

    # -- the end of a job ----------------------------------------------------------------------
    async def _finalize(self, job: RunningJob, state: JobState) -> None:
        spec = job.spec
        try:
            size, seconds = await self._io(self._encode, spec)
        except JobFailed as e:
            await self._finish(job, "failed", str(e))
            return
        state.audio_bytes = size
        state.audio_seconds = round(seconds, 3)
        await self._finish(job, "done", None, state)
        with contextlib.suppress(OSError):
            await self._io(self.store.remove_units, spec.id)
        log.info("jobs: %s done: %.1f s of audio, %d bytes", spec.id, seconds, size)

    def _encode(self, spec: JobSpec) -> tuple[int, float]:
        """The whole file, from every unit in order: (its size, its audio seconds)."""
        fmt = OutputFormat(spec.response_format, spec.sample_rate, spec.bitrate)  # type: ignore[arg-type]
        encoder = make_output(fmt, spec.speed)
        pcm_bytes = 0

        def chunks():  # type: ignore[no-untyped-def]
            nonlocal pcm_bytes
            for index in range(len(spec.units)):
                try:
                    pcm = self.store.read_unit(spec.id, index)
                except OSError as e:
                    raise JobFailed(
                        f"unit {index + 1} cannot be read: {describe_os_error(e)}"
                    ) from None
                if len(pcm) % 2:
                    raise JobFailed(f"unit {index + 1} is corrupt ({len(pcm)} bytes, odd)")
                pcm_bytes += len(pcm)
                if out := encoder.encode(pcm):
                    yield out
            if tail := encoder.finish():
                yield tail

        patch = _wav_sizes if spec.response_format == "wav" else None
        path = self.store.audio_path(spec)
        seal = None
        if self.signer is not None and spec.response_format in SIGNED_MIME:
            signer, codec = self.signer, spec.response_format

            def seal(whole: BinaryIO, out: BinaryIO) -> None:
                signer.sign(whole, out, codec, path.name)

        try:
            size = write_atomic(path, chunks(), patch, seal)
        except OSError as e:
            raise JobFailed(
                f"the audio file could not be written: {describe_os_error(e)}"
            ) from None
        except SigningFailed as e:
            raise JobFailed(f"the audio file could not be signed (C2PA): {e}") from None
        finally:
            encoder.close()
        return size, pcm_bytes / BYTES_PER_SECOND / spec.speed

    async def _finish(
        self, job: RunningJob, name: str, reason: str | None, state: JobState | None = None
    ) -> None:
        """Write the job's last state (done, failed, cancelled)."""
        job_id = job.spec.id
        if state is None:
            try:
                state = await self._io(self.store.state, job_id)
            except (CorruptJob, KeyError):
                state = JobState()
        state.state = name  # type: ignore[assignment]
        state.reason = reason
        state.finished_at = time.time()
        try:
            await self._io(self.store.write_state, job_id, state)
        except OSError as e:
            # Left as it was on disk: a later pass (of this process or another) takes it up
            # again and meets the same fault, or not.
            log.error(
                "jobs: %s %s, and its state could not be written (%s); not taken up again "
                "by this process for %.0f s", job_id, name, e, UNRECORDED_BACKOFF_S,
            )  # fmt: skip
            self._backoff[job_id] = time.monotonic() + UNRECORDED_BACKOFF_S
            return
        if name == "failed":
            log.warning("jobs: %s failed: %s", job_id, reason)
        elif name == "cancelled":
            log.info("jobs: %s cancelled", job_id)
        if name != "done":  # nothing can resume it: its units' disk is freed now
            with contextlib.suppress(OSError):
                await self._io(self.store.remove_units, job_id)
