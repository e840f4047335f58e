"""``/v1/audio/jobs``: create, list, look at, fetch and cancel/delete long-form jobs.

Every answer is read from disk (``JobStore``), so any gateway process answers for any job,
whichever process runs it. A job belongs to the API key that created it (``owner_of``); other
keys get 404 for it, as for a job that does not exist, and do not see it listed. Admin keys
(``gateway.admin_keys``) see and may cancel or delete every job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
from aiohttp import web

from common.config.jobs import JobsConfig
from common.provenance.signing import load_signer
from gateway.audio.formats import CONTENT_TYPES
from gateway.edge.auth import ApiKeys, presented_key
from gateway.errors import APIError
from gateway.frontends.text_units import UnitSplitter
from gateway.jobs.runner import JobRunner
from gateway.jobs.store import (
    FINISHED,
    JobLock,
    JobSpec,
    JobStore,
    JobView,
    describe_os_error,
    new_job_id,
    owner_of,
)
from gateway.schemas import (
    SamplingFields,
    VoiceRef,
    bad_request,
    build_params,
    sampling_overrides,
)
from gateway.service import Gateway
from gateway.text.breaks import Pause, cap_ms, join_breaks
from shm.records import SAMPLE_RATE
from store.voices import resolve_state_dir

log = logging.getLogger(__name__)

PATH = "/v1/audio/jobs"
AUDIO_PATH = PATH + "/{job_id}/audio"
DELETE_WAIT_S = 5.0
T = TypeVar("T")
_json = msgspec.json.Encoder()


class JobRequest(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/audio/jobs``: ``/v1/audio/speech``'s fields, without the streaming
    ones; ``input`` may be as long as ``jobs.max_text_chars``."""

    input: str
    model: str | None = None
    voice: str | VoiceRef | None = None
    response_format: str = "mp3"
    sample_rate: int | None = None
    speed: float = 1.0
    instructions: str | None = None


_request_decoder = msgspec.json.Decoder(JobRequest)


def jobs_dir(gateway: Gateway) -> str:
    cfg = gateway.config
    return cfg.jobs.dir or str(resolve_state_dir(cfg.voices.state_dir) / "jobs")


def split_units(text: str, max_chars: int) -> list[str]:
    """The job's units: the streaming protocols' sentence splitter over the whole text
    (checked by ``build_params``), a longer sentence cut at a space before ``max_chars``
    (``llm.max_chars_per_segment``: the piece the model speaks without looping). A unit after
    a break tag starts with its pause, as a tag (the unit's request pushes its silence first:
    ``gateway.text.pauses``); pauses after the last words end the last unit."""
    splitter = UnitSplitter("sentence", max_chars, None)
    out: list[str] = []
    for u in (*splitter.feed(text), *splitter.flush()):
        pause = [Pause(u.pause_ms)] if u.pause_ms else []
        if u.text or not out:
            out.append(join_breaks([*pause, u.text]))
        else:
            out[-1] += join_breaks(pause)
    return out


def _response(
    obj: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_json.encode(obj), status=status, content_type="application/json", headers=headers
    )


def _not_found(job_id: str) -> APIError:
    return APIError(404, "job_not_found", f"no job {job_id!r}")


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, up to ``limit`` bytes (the jobs' own limit, above the app's), else 413."""
    if request.content_length is not None and request.content_length > limit:
        raise APIError(
            413,
            "request_too_large",
            f"request body of {request.content_length} bytes exceeds the {limit}-byte limit "
            "(jobs.max_body_bytes)",
        )
    body = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise APIError(
                413,
                "request_too_large",
                f"request body exceeds the {limit}-byte limit (jobs.max_body_bytes)",
            )
    return bytes(body)


class JobsApi:
    """The handlers, on one store and this process's runner."""

    def __init__(self, gateway: Gateway, store: JobStore, runner: JobRunner) -> None:
        self.gateway = gateway
        self.config: JobsConfig = gateway.config.jobs
        self.store = store
        self.runner = runner
        self.admin = ApiKeys(gateway.config.gateway.admin_keys)

    async def _io(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _caller(self, request: web.Request) -> tuple[str, bool]:
        key = presented_key(request)
        return owner_of(key), bool(key) and self.admin.required and self.admin.allows(key)

    async def _visible(self, request: web.Request) -> JobView:
        """The job of the URL, if the caller may see it (else 404, as if it did not exist)."""
        job_id = request.match_info["job_id"]
        owner, admin = self._caller(request)
        try:
            view, job_owner = await self._io(self.store.owned_view, job_id)
        except KeyError:
            raise _not_found(job_id) from None
        if not admin and job_owner != owner:
            raise _not_found(job_id)
        return view

    # -- POST /v1/audio/jobs -------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        cfg = self.config
        owner, _ = self._caller(request)
        body = await _read_body(request, cfg.max_body_bytes)
        try:
            req = _request_decoder.decode(body)
        except msgspec.ValidationError as e:
            raise bad_request(str(e)) from None
        except msgspec.DecodeError as e:
            raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
        if len(req.input) > cfg.max_text_chars:
            raise APIError(
                413,
                "text_too_long",
                f"`input` has {len(req.input)} characters; a job takes at most "
                f"{cfg.max_text_chars} (jobs.max_text_chars)",
                param="input",
            )
        g = self.gateway
        params = build_params(
            g.voices,
            g.limits,
            text=req.input,
            voice=req.voice if not isinstance(req.voice, VoiceRef) else req.voice.id,
            max_chars=None,
            response_format=req.response_format,
            sample_rate=req.sample_rate,
            speed=req.speed,
            sampling=sampling_overrides(req),
            max_break_ms=cap_ms(g.config.gateway.max_break_s),
        )
        units = split_units(params.text, g.config.llm.max_chars_per_segment)
        if not units:
            raise bad_request("`input` must contain some text", code="empty_input", param="input")
        await self._io(self._check_quota, owner)
        spec = JobSpec(
            id=new_job_id(),
            owner=owner,
            created_at=time.time(),
            voice=params.voice,
            response_format=params.response_format,
            sample_rate=params.sample_rate,
            bitrate=params.bitrate,
            speed=params.speed,
            sampling=params.sampling,
            text_chars=len(params.text),
            units=units,
        )
        try:
            await self._io(self.store.create, spec)
        except OSError as e:
            raise APIError(
                507, "jobs_storage_error", f"the job could not be stored: {describe_os_error(e)}"
            ) from None
        self.runner.wake()
        view = await self._io(self.store.view, spec.id)
        return _response(view, 202, {"Location": view.url})

    def _check_quota(self, owner: str) -> None:
        cfg = self.config
        mine = []
        for job_id in self.store.ids():
            with contextlib.suppress(KeyError):
                if self.store.owned_view(job_id)[1] == owner:
                    mine.append(job_id)
        if len(mine) >= cfg.max_jobs_per_key:
            raise APIError(
                429,
                "job_quota_exceeded",
                f"this key has {len(mine)} jobs; the limit is {cfg.max_jobs_per_key} "
                "(jobs.max_jobs_per_key): delete finished ones first",
            )
        used = sum(self.store.disk_used(j) for j in mine)
        if used >= cfg.max_bytes_per_key:
            raise APIError(
                429,
                "job_quota_exceeded",
                f"this key's jobs take {used} bytes; the limit is {cfg.max_bytes_per_key} "
                "(jobs.max_bytes_per_key): delete finished ones first",
            )

    # -- GET -----------------------------------------------------------------------------------
    async def list(self, request: web.Request) -> web.Response:
        owner, admin = self._caller(request)

        def views() -> list[JobView]:
            out: list[JobView] = []
            for job_id in self.store.ids():
                with contextlib.suppress(KeyError):  # deleted meanwhile
                    view, job_owner = self.store.owned_view(job_id)
                    if admin or job_owner == owner:
                        out.append(view)
            return out

        found = sorted(await self._io(views), key=lambda v: v.created_at or 0.0, reverse=True)
        return _response({"object": "list", "data": [v for v in found]})

    async def get(self, request: web.Request) -> web.Response:
        return _response(await self._visible(request))

    async def audio(self, request: web.Request) -> web.StreamResponse:
        view = await self._visible(request)
        spec = await self._io(self.store.spec, view.id) if view.voice is not None else None
        if view.state == "done" and spec is not None:
            path = self.store.audio_path(spec)
            content_type = _content_type(spec)
            return web.FileResponse(
                path,
                headers={
                    "Content-Type": content_type,
                    "Content-Disposition": f'attachment; filename="{spec.id}.{spec.response_format}"',
                    "X-Job-State": "done",
                },
            )
        if view.state in ("queued", "running") and spec is not None and _raw_pcm(spec):
            return await self._partial(request, spec, view)
        if view.state in ("failed", "cancelled"):
            raise APIError(
                409, f"job_{view.state}", f"job {view.id} {view.state}: {view.reason or ''}".strip()
            )
        raise APIError(
            409,
            "job_not_done",
            f"job {view.id} is {view.state} ({view.progress.units_done} of "
            f"{view.progress.units_total} units); its {view.response_format} file is made when "
            "every unit is done (the audio made so far is served for response_format=pcm)",
        )

    async def _partial(
        self, request: web.Request, spec: JobSpec, view: JobView
    ) -> web.StreamResponse:
        """The raw PCM of the units finished in order so far (a prefix of the final file)."""
        done = await self._io(self.store.done_units, spec.id)
        sizes: list[int] = []
        while len(sizes) in done:
            sizes.append(done[len(sizes)])
        resp = web.StreamResponse(
            headers={
                "Content-Type": "audio/pcm",
                "X-Job-State": view.state,
                "X-Job-Units": f"{len(sizes)}/{len(spec.units)}",
            }
        )
        resp.content_length = sum(sizes)
        await resp.prepare(request)
        for index in range(len(sizes)):
            try:
                data = await self._io(self.store.read_unit, spec.id, index)
            except OSError:
                break  # finished meanwhile (its units removed): the client asks again
            await resp.write(data)
        await resp.write_eof()
        return resp

    # -- DELETE --------------------------------------------------------------------------------
    async def delete(self, request: web.Request) -> web.Response:
        view = await self._visible(request)
        if view.state in ("queued", "running"):
            await self._io(self.store.request_cancel, view.id)
            if not self.runner.cancel_local(view.id):
                await self._io(self._cancel_unclaimed, view.id)
            return _response(await self._io(self.store.view, view.id))
        lock = await self._lock_soon(view.id)
        if lock is None:
            raise APIError(
                409, "job_stopping", f"job {view.id} is still stopping; delete it again shortly"
            )
        try:
            await self._io(self.store.remove, view.id)
        finally:
            lock.release()
        return _response({"id": view.id, "object": "audio.job.deleted", "deleted": True})

    async def _lock_soon(self, job_id: str) -> JobLock | None:
        """The job's lock, waiting up to ``DELETE_WAIT_S`` for its runner to let go of it (a
        job just finished or cancelled: its last files are being removed)."""
        deadline = asyncio.get_running_loop().time() + DELETE_WAIT_S
        while (lock := await self._io(JobLock.try_take, self.store.path(job_id))) is None:
            if asyncio.get_running_loop().time() > deadline:
                return None
            await asyncio.sleep(0.02)
        return lock

    def _cancel_unclaimed(self, job_id: str) -> None:
        """Write ``cancelled`` for a job no process runs now (else its runner does)."""
        lock = JobLock.try_take(self.store.path(job_id))
        if lock is None:
            return
        try:
            state = self.store.state(job_id)
            if state.state not in FINISHED:
                state.state = "cancelled"
                state.finished_at = time.time()
                self.store.write_state(job_id, state)
                self.store.remove_units(job_id)
        finally:
            lock.release()


def _raw_pcm(spec: JobSpec) -> bool:
    """The final file is the units' PCM as written: its prefix can be served while running."""
    return spec.response_format == "pcm" and spec.sample_rate == SAMPLE_RATE and spec.speed == 1.0


def _content_type(spec: JobSpec) -> str:
    return CONTENT_TYPES.get(spec.response_format, "application/octet-stream")  # type: ignore[call-overload]


def setup(app: web.Application, gateway: Gateway) -> JobsApi:
    """Add the jobs' routes to ``app``, and run this process's ``JobRunner`` while it runs."""
    store = JobStore(jobs_dir(gateway))
    config = gateway.config
    signer = load_signer(config.jobs, config.llm.model)  # checked at start by the orchestrator
    if signer is None:
        log.info(
            "jobs: WAV and MP3 files are unsigned: no C2PA manifest (set jobs.c2pa_cert and "
            "jobs.c2pa_key to sign them, docs/operations.md)"
        )
    runner = JobRunner(gateway, config.jobs, store, signer)
    api = JobsApi(gateway, store, runner)

    async def on_startup(_: web.Application) -> None:
        runner.start()

    async def on_cleanup(_: web.Application) -> None:
        await runner.close()
        if signer is not None:
            signer.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post(PATH, api.create)
    app.router.add_get(PATH, api.list)
    app.router.add_get(PATH + "/{job_id}", api.get)
    app.router.add_delete(PATH + "/{job_id}", api.delete)
    app.router.add_get(AUDIO_PATH, api.audio)
    return api
