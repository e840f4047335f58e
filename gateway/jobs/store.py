"""The jobs' durable state: one directory per job, written atomically.

::

    <jobs.dir>/<job id>/
        job.json        JobSpec: owner, settings, the units' text (written once, at creation)
        state.json      JobState: queued | running | done | failed | cancelled, and why
        units/000017.pcm  a finished unit's audio (24 kHz s16le mono), written once
        audio.<ext>     the whole file, encoded once every unit is there
        cancel          present: the job was cancelled (by any gateway process)
        lock            flock'd by the one process that runs the job

Every file is written to a temporary name, fsync'd, renamed into place, and its directory
fsync'd: after a kill -9 a file is whole or absent, never half written. A unit's file is
therefore the proof that the unit was spoken: a resumed job speaks exactly the units that
have none. A directory whose ``job.json`` or ``state.json`` cannot be read is reported as a
failed job with the reason (``JobView``), and nothing else is affected.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

import msgspec

from shm.messages import SamplingOverrides
from shm.records import SAMPLE_RATE
from store.durable import fsync_dir

JobStateName = Literal["queued", "running", "done", "failed", "cancelled"]
FINISHED: frozenset[str] = frozenset({"done", "failed", "cancelled"})
ID_RE = re.compile(r"^job_[0-9a-f]{24}$")
UNIT_SUFFIX = ".pcm"
BYTES_PER_SECOND = SAMPLE_RATE * 2
TRASH_PREFIX = ".trash-"


class JobSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a job speaks and how: fixed at creation."""

    id: str
    owner: str
    """``owner_of`` the API key that created it ("" with no key)."""
    created_at: float
    voice: str
    response_format: str
    sample_rate: int
    bitrate: str | None = None
    speed: float = 1.0
    sampling: SamplingOverrides = SamplingOverrides()
    text_chars: int
    units: list[str]


class JobState(msgspec.Struct, kw_only=True):
    """Where a job is; replaced whole on every change."""

    state: JobStateName = "queued"
    reason: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    run_started_at: float | None = None
    """When the process now running it took it (the rate and ETA are measured from there)."""
    units_at_run_start: int = 0
    audio_bytes: int = 0
    """Size of the final file, once done."""
    audio_seconds: float = 0.0
    """Audio of the final file, once done."""


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    units_done: int
    units_total: int
    audio_seconds: float
    units_per_second: float | None = None
    eta_seconds: float | None = None


class JobView(msgspec.Struct, frozen=True, kw_only=True):
    """A job as ``GET /v1/audio/jobs/{id}`` answers it."""

    id: str
    object: str = "audio.job"
    state: JobStateName
    reason: str | None = None
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    voice: str | None = None
    response_format: str | None = None
    sample_rate: int | None = None
    text_chars: int = 0
    progress: Progress
    audio_bytes: int = 0
    url: str
    audio_url: str


class CorruptJob(Exception):
    """A job directory whose files cannot be read: the job fails with this reason."""


_spec_decoder = msgspec.json.Decoder(JobSpec)
_state_decoder = msgspec.json.Decoder(JobState)
_encoder = msgspec.json.Encoder()


def owner_of(key: str) -> str:
    """The owner recorded for an API key: a digest (the key itself is never written)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


def new_job_id() -> str:
    return f"job_{secrets.token_hex(12)}"


def describe_os_error(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the jobs' disk is full ({e.strerror})"
    return f"{type(e).__name__}: {e.strerror or e}"


def write_atomic(
    path: Path,
    data: bytes | Iterator[bytes],
    patch: Callable[[BinaryIO, int], None] | None = None,
    seal: Callable[[BinaryIO, BinaryIO], None] | None = None,
) -> int:
    """Write ``data`` to ``path`` all or nothing (tmp, fsync, rename, fsync the directory);
    the bytes written. ``patch(file, size)`` may rewrite a header once the size is known;
    ``seal(whole, out)`` may then write the file anew (a signed copy: C2PA) into ``out``, which
    becomes ``path``. An ``OSError`` (a full disk) or any other error leaves no temporary file
    behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    sealed = tmp.with_name(tmp.name + "-sealed")
    n = 0
    try:
        with open(tmp, "w+b" if seal else "wb") as f:
            for chunk in (data,) if isinstance(data, bytes) else data:
                f.write(chunk)
                n += len(chunk)
            if patch is not None:
                patch(f, n)
            if seal is not None:
                f.flush()
                f.seek(0)
                with open(sealed, "wb") as out:
                    seal(f, out)
                    out.flush()
                    os.fsync(out.fileno())
                    n = os.fstat(out.fileno()).st_size
            else:
                f.flush()
                os.fsync(f.fileno())
        if seal is not None:
            os.replace(sealed, path)
            tmp.unlink()
        else:
            os.replace(tmp, path)
    except BaseException:
        for left in (tmp, sealed):
            with contextlib.suppress(OSError):
                left.unlink()
        raise
    fsync_dir(path.parent)
    return n


class JobLock:
    """The exclusive, non-blocking ``flock`` of one job: the process holding it runs the job.
    The kernel releases it when that process dies, however it dies."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def try_take(cls, directory: Path) -> JobLock | None:
        try:
            fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


class NodeGate:
    """A node-wide lock (``flock`` on ``<jobs.dir>/.admit.lock``) that one gateway process at
    a time holds while a unit checks for room and is admitted: the units of several gateway
    processes never pass the reserve check together."""

    def __init__(self, root: Path) -> None:
        self._path = root / ".admit.lock"
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        if self._fd is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JobStore:
    """The jobs directory. Blocking file I/O: call it from an executor on the event loop."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.expanduser(os.path.expandvars(str(root))))

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, job_id: str) -> Path:
        if not ID_RE.match(job_id):
            raise KeyError(job_id)
        return self.root / job_id

    def ids(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if ID_RE.match(n))

    # -- creation ------------------------------------------------------------------------------
    def create(self, spec: JobSpec) -> None:
        """Write a new job (queued). Its directory appears whole or not at all: it is built
        under a temporary name and renamed."""
        self.ensure()
        tmp = self.root / f"{TRASH_PREFIX}new-{spec.id}"
        try:
            (tmp / "units").mkdir(parents=True)
            write_atomic(tmp / "owner", spec.owner.encode())
            write_atomic(tmp / "job.json", _encoder.encode(spec))
            write_atomic(tmp / "state.json", _encoder.encode(JobState()))
            os.rename(tmp, self.root / spec.id)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # -- reading -------------------------------------------------------------------------------
    def spec(self, job_id: str) -> JobSpec:
        try:
            spec = _spec_decoder.decode((self.path(job_id) / "job.json").read_bytes())
        except FileNotFoundError:
            if not self.path(job_id).exists():
                raise KeyError(job_id) from None
            raise CorruptJob("job.json is missing") from None
        except (OSError, msgspec.DecodeError) as e:
            raise CorruptJob(f"job.json cannot be read: {e}") from None
        if spec.id != job_id:
            raise CorruptJob(f"job.json names job {spec.id!r}")
        return spec

    def state(self, job_id: str) -> JobState:
        try:
            return _state_decoder.decode((self.path(job_id) / "state.json").read_bytes())
        except FileNotFoundError:
            if not self.path(job_id).exists():
                raise KeyError(job_id) from None
            raise CorruptJob("state.json is missing") from None
        except (OSError, msgspec.DecodeError) as e:
            raise CorruptJob(f"state.json cannot be read: {e}") from None

    def unit_path(self, job_id: str, index: int) -> Path:
        return self.path(job_id) / "units" / f"{index:06d}{UNIT_SUFFIX}"

    def done_units(self, job_id: str) -> dict[int, int]:
        """The finished units and their sizes in bytes."""
        out: dict[int, int] = {}
        try:
            entries = list(os.scandir(self.path(job_id) / "units"))
        except FileNotFoundError:
            return out
        for entry in entries:
            name = entry.name
            if name.endswith(UNIT_SUFFIX) and name[:6].isdigit() and len(name) == 10:
                with contextlib.suppress(FileNotFoundError):
                    out[int(name[:6])] = entry.stat().st_size
        return out

    def audio_path(self, spec: JobSpec) -> Path:
        return self.path(spec.id) / f"audio.{spec.response_format}"

    def cancelled(self, job_id: str) -> bool:
        return (self.path(job_id) / "cancel").exists()

    def disk_used(self, job_id: str | None = None) -> int:
        """Bytes under one job's directory, or under every job's."""
        roots = [self.path(job_id)] if job_id else [self.root / i for i in self.ids()]
        total = 0
        for root in roots:
            for dirpath, _, files in os.walk(root):
                for name in files:
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(dirpath, name)).st_size
        return total

    def view(self, job_id: str, now: float | None = None) -> JobView:
        """The job as the API shows it; a corrupt one as failed, with the reason."""
        return self.owned_view(job_id, now)[0]

    def owned_view(self, job_id: str, now: float | None = None) -> tuple[JobView, str]:
        """``view`` and the job's owner."""
        url = f"/v1/audio/jobs/{job_id}"
        try:
            spec = self.spec(job_id)
            state = self.state(job_id)
        except CorruptJob as e:
            view = JobView(
                id=job_id,
                state="failed",
                reason=f"corrupt job directory: {e}",
                progress=Progress(units_done=0, units_total=0, audio_seconds=0.0),
                url=url,
                audio_url=f"{url}/audio",
            )
            return view, self._owner_hint(job_id)
        done = self.done_units(job_id) if state.state != "done" else {}
        n_done = len(spec.units) if state.state == "done" else len(done)
        audio_s = (
            state.audio_seconds
            if state.state == "done"
            else sum(done.values()) / BYTES_PER_SECOND / spec.speed
        )
        name = state.state
        if name in ("queued", "running") and self.cancelled(job_id):
            name = "cancelled"
        rate = eta = None
        if name == "running" and state.run_started_at is not None:
            elapsed = (now or time.time()) - state.run_started_at
            made = n_done - state.units_at_run_start
            if made > 0 and elapsed > 0:
                rate = made / elapsed
                eta = (len(spec.units) - n_done) / rate
        view = JobView(
            id=job_id,
            state=name,
            reason=state.reason,
            created_at=spec.created_at,
            started_at=state.started_at,
            finished_at=state.finished_at,
            voice=spec.voice,
            response_format=spec.response_format,
            sample_rate=spec.sample_rate,
            text_chars=spec.text_chars,
            progress=Progress(
                units_done=n_done,
                units_total=len(spec.units),
                audio_seconds=round(float(audio_s), 3),
                units_per_second=None if rate is None else round(rate, 4),
                eta_seconds=None if eta is None else round(eta, 1),
            ),
            audio_bytes=state.audio_bytes,
            url=url,
            audio_url=f"{url}/audio",
        )
        return view, spec.owner

    def _owner_hint(self, job_id: str) -> str:
        """The owner of a job whose ``job.json`` is unreadable: from its ``owner`` file."""
        try:
            return (self.path(job_id) / "owner").read_text().strip()
        except OSError:
            return ""

    # -- writing (the runner holding the job's lock, or the API for a job nobody runs) -------
    def write_state(self, job_id: str, state: JobState) -> None:
        write_atomic(self.path(job_id) / "state.json", _encoder.encode(state))

    def write_unit(self, job_id: str, index: int, pcm: bytes) -> int:
        return write_atomic(self.unit_path(job_id, index), pcm)

    def read_unit(self, job_id: str, index: int) -> bytes:
        return self.unit_path(job_id, index).read_bytes()

    def request_cancel(self, job_id: str) -> None:
        write_atomic(self.path(job_id) / "cancel", b"")

    def remove(self, job_id: str) -> None:
        """Delete a job: its directory leaves the listing at once (renamed), then goes."""
        src = self.path(job_id)
        trash = self.root / f"{TRASH_PREFIX}{job_id}-{secrets.token_hex(4)}"
        os.rename(src, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def remove_units(self, job_id: str) -> None:
        shutil.rmtree(self.path(job_id) / "units", ignore_errors=True)

    def clean_trash(self, older_than_s: float = 3600.0) -> None:
        """Remove what a process that died while creating or deleting a job left (an hour
        old: a job being created by another process right now is not touched)."""
        cutoff = time.time() - older_than_s
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.root):
                path = self.root / name
                with contextlib.suppress(OSError):
                    if name.startswith(TRASH_PREFIX) and path.stat().st_mtime < cutoff:
                        shutil.rmtree(path, ignore_errors=True)
