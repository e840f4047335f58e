"""``orpheus-serve say --file chapter.txt -o chapter.mp3``: a long text as a job of a running
server (``/v1/audio/jobs``), with a progress bar, into one file.

The job lives on the server: a Ctrl-C stops only this client (the job goes on) and prints
the command that picks it up again (``--resume ID``). The output format is the file name's
extension (``.mp3``, ``.wav``, ``.flac``, ``.opus``, ``.aac``, ``.pcm``) unless
``--format`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

FORMATS = ("mp3", "wav", "flac", "opus", "aac", "pcm")
POLL_S = 0.5


class JobError(RuntimeError):
    """The server refused or failed the job (the message is its reason)."""


class JobClient:
    """The few calls of the jobs API, with the standard library (no extra for a CLI)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise JobError(_error_line(e)) from None

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/audio/jobs", body)  # type: ignore[no-any-return]

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/audio/jobs/{job_id}")  # type: ignore[no-any-return]

    def download(self, job_id: str, path: str) -> int:
        """The finished job's file, written to ``path`` whole (a temporary name, renamed)."""
        req = urllib.request.Request(
            f"{self.url}/v1/audio/jobs/{job_id}/audio", headers=self.headers
        )
        tmp = f"{path}.part"
        n = 0
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp, open(tmp, "wb") as f:
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
                    n += len(chunk)
                expected = resp.headers.get("Content-Length")
            if expected is not None and int(expected) != n:
                raise JobError(f"the download was cut short ({n} of {expected} bytes)")
            os.replace(tmp, path)
        except urllib.error.HTTPError as e:
            raise JobError(_error_line(e)) from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return n


def _error_line(e: urllib.error.HTTPError) -> str:
    try:
        err = json.loads(e.read())["error"]
        return f"server answered {e.code} {err.get('code')}: {err.get('message')}"
    except Exception:
        return f"server answered {e.code} {e.reason}"


def output_format(args: argparse.Namespace) -> str:
    if args.format:
        return str(args.format)
    ext = os.path.splitext(args.output)[1].lstrip(".").lower()
    if ext not in FORMATS:
        raise JobError(
            f"cannot tell the format of {args.output!r}: use --format ({', '.join(FORMATS)})"
        )
    return ext


def job_body(args: argparse.Namespace, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input": text,
        "voice": args.voice,
        "response_format": output_format(args),
    }
    for key in ("max_tokens", "seed"):
        if getattr(args, key, None) is not None:
            body[key] = getattr(args, key)
    return body


def describe(job: dict[str, Any]) -> str:
    p = job["progress"]
    line = f"{p['units_done']}/{p['units_total']} units, {p['audio_seconds'] / 60:.1f} min of audio"
    if p.get("units_per_second"):
        line += f", {p['units_per_second']:.2f} units/s"
    if p.get("eta_seconds") is not None:
        line += f", ETA {p['eta_seconds']:.0f} s"
    return line


def follow(
    client: JobClient, job_id: str, on_progress: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Poll the job until it is finished; its last state."""
    while True:
        job = client.get(job_id)
        on_progress(job)
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(POLL_S)


def _progress_printer() -> tuple[Callable[[dict[str, Any]], None], Callable[[], None]]:
    """A rich progress bar on a terminal; one line per change otherwise (logs, tests)."""
    if sys.stderr.isatty():
        try:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            pass
        else:
            bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            task = bar.add_task("queued", total=None, detail="")
            bar.start()

            def show(job: dict[str, Any]) -> None:
                p = job["progress"]
                bar.update(
                    task,
                    description=job["state"],
                    total=p["units_total"] or None,
                    completed=p["units_done"],
                    detail=describe(job),
                )

            return show, bar.stop
    last = [""]

    def plain(job: dict[str, Any]) -> None:
        line = f"{job['state']}: {describe(job)}"
        if line != last[0]:
            print(line, file=sys.stderr, flush=True)
            last[0] = line

    return plain, lambda: None


def say_file(args: argparse.Namespace) -> int:
    client = JobClient(args.url, args.api_key)
    job_id: str | None = args.resume
    show, stop = _progress_printer()
    try:
        if job_id is None:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
            job = client.create(job_body(args, text))
            job_id = job["id"]
            print(
                f"job {job_id}: {job['progress']['units_total']} units", file=sys.stderr, flush=True
            )
        job = follow(client, job_id, show)
        stop()
        if job["state"] != "done":
            print(
                f"orpheus-serve say: job {job_id} {job['state']}: {job.get('reason')}",
                file=sys.stderr,
            )
            return 1
        n = client.download(job_id, args.output)
    except KeyboardInterrupt:
        stop()
        if job_id is None:
            print("orpheus-serve say: interrupted before the job was created", file=sys.stderr)
        else:
            print(
                f"orpheus-serve say: stopped following job {job_id}; it goes on on the server. "
                f"Pick it up with: orpheus-serve say --resume {job_id} -o {args.output}",
                file=sys.stderr,
            )
        return 130
    except (JobError, OSError) as exc:
        stop()
        print(f"orpheus-serve say: {exc}", file=sys.stderr)
        return 1
    p = job["progress"]
    print(f"wrote {args.output}: {n} bytes, {p['audio_seconds']:.1f} s of audio (job {job_id})")
    return 0
