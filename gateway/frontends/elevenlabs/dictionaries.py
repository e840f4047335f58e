"""ElevenLabs' pronunciation dictionary routes (``/v1/pronunciation-dictionaries``), as the
official SDK calls them (``client.pronunciation_dictionaries``)::

    POST /v1/pronunciation-dictionaries/add-from-rules     {"name", "rules", "description"?}
    POST /v1/pronunciation-dictionaries/add-from-file      multipart: name, file (PLS), description?
    GET  /v1/pronunciation-dictionaries                    ?cursor&page_size&sort&sort_direction
    GET  /v1/pronunciation-dictionaries/{id}               metadata and the latest rules
    PATCH /v1/pronunciation-dictionaries/{id}              {"name"?, "archived"?}
    POST /v1/pronunciation-dictionaries/{id}/add-rules     {"rules"}: a new version
    POST /v1/pronunciation-dictionaries/{id}/remove-rules  {"rule_strings"}: a new version
    POST /v1/pronunciation-dictionaries/{id}/set-rules     {"rules"}: a new version
    GET  /v1/pronunciation-dictionaries/{id}/{version_id}/download   the version as PLS

The store, its limits and its ownership rules are ``gateway.text`` 's; what a request may
name in ``pronunciation_dictionary_locators`` is what ``GET`` lists for its key. An
``archived`` dictionary is removed (this server keeps no archive: its file is deleted).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from aiohttp import BodyPartReader, web

from gateway.edge.auth import presented_key
from gateway.errors import APIError
from gateway.frontends.shared import Handler, read_body
from gateway.service import Gateway
from gateway.text.lexicon import AliasRule, Rule, RuleError, check_rules
from gateway.text.pls import PlsError, read_pls, write_pls
from gateway.text.service import SpeechText
from gateway.text.store import (
    DictionaryRecord,
    DictionaryStore,
    NoSuchDictionary,
    TooManyDictionaries,
)

BASE = "/v1/pronunciation-dictionaries"
MAX_NAME_CHARS = 256
MAX_DESCRIPTION_CHARS = 1000
MAX_PAGE = 100


class AddFromRules(msgspec.Struct, kw_only=True):
    name: str
    rules: list[Rule]
    description: str | None = None
    workspace_access: str | None = None


class RulesBody(msgspec.Struct, kw_only=True):
    rules: list[Rule]


class RemoveRulesBody(msgspec.Struct, kw_only=True):
    rule_strings: list[str]


class UpdateBody(msgspec.Struct, kw_only=True):
    name: str | None = None
    archived: bool | None = None


class Created(msgspec.Struct, kw_only=True):
    """ElevenLabs' ``AddPronunciationDictionaryResponseModel``."""

    id: str
    name: str
    created_by: str
    creation_time_unix: int
    version_id: str
    version_rules_num: int
    description: str | None = None
    permission_on_resource: str = "admin"


class Metadata(msgspec.Struct, kw_only=True):
    """ElevenLabs' ``GetPronunciationDictionaryMetadataResponse``."""

    id: str
    latest_version_id: str
    latest_version_rules_num: int
    name: str
    created_by: str
    creation_time_unix: int
    description: str | None = None
    permission_on_resource: str = "admin"
    archived_time_unix: int | None = None


class WithRules(Metadata, kw_only=True):
    rules: list[AliasRule]


class Listing(msgspec.Struct, kw_only=True):
    pronunciation_dictionaries: list[Metadata]
    has_more: bool
    next_cursor: str | None = None


class RulesChanged(msgspec.Struct, kw_only=True):
    """ElevenLabs' ``PronunciationDictionaryRulesResponseModel``."""

    id: str
    version_id: str
    version_rules_num: int


def _json(body: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, code, message, param=param)


def _created_by(record: DictionaryRecord) -> str:
    return record.owner or "orpheus-serve"


def _metadata(record: DictionaryRecord) -> Metadata:
    return Metadata(
        id=record.id,
        latest_version_id=record.latest.version_id,
        latest_version_rules_num=len(record.latest.rules),
        name=record.name,
        created_by=_created_by(record),
        creation_time_unix=record.created_at,
        description=record.description,
    )


def _name(name: str | None) -> str:
    name = (name or "").strip()
    if not name:
        raise _bad("name: required", "name")
    if len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise _bad(f"name: at most {MAX_NAME_CHARS} characters, no NUL", "name")
    return name


def _description(text: str | None) -> str | None:
    if text is not None and (len(text) > MAX_DESCRIPTION_CHARS or "\x00" in text):
        raise _bad(f"description: at most {MAX_DESCRIPTION_CHARS} characters", "description")
    return text or None


def _decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise _bad(f"invalid body: {e}") from None
    except msgspec.DecodeError as e:
        raise _bad(f"request body is not valid JSON: {e}", code="invalid_json") from None


def _rules(text: SpeechText, rules: list[Rule]) -> list[AliasRule]:
    try:
        return check_rules(rules, text.cfg.max_dictionary_rules)
    except RuleError as e:
        raise _bad(str(e), "rules", code="invalid_rule") from None


async def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A store call, off the event loop (it fsyncs and takes a file lock)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: fn(*args, **kwargs))


class _Routes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    @property
    def text(self) -> SpeechText:
        return self.gateway.speech_text

    @property
    def store(self) -> DictionaryStore:
        return self.gateway.speech_text.store

    async def _create(
        self,
        request: web.Request,
        name: str,
        description: str | None,
        rules: list[AliasRule],
        language: str | None = None,
    ) -> web.Response:
        cfg = self.text.cfg
        try:
            record = await _run(
                self.store.create,
                name=name,
                description=description,
                owner=self.text.owner_of(presented_key(request)),
                rules=rules,
                max_dictionaries=cfg.max_dictionaries,
                language=language,
            )
        except TooManyDictionaries:
            raise APIError(
                409,
                "too_many_dictionaries",
                f"the server holds its limit of {cfg.max_dictionaries} pronunciation "
                "dictionaries (text.max_dictionaries)",
            ) from None
        v = record.latest
        return _json(
            Created(
                id=record.id,
                name=record.name,
                created_by=_created_by(record),
                creation_time_unix=record.created_at,
                version_id=v.version_id,
                version_rules_num=len(v.rules),
                description=record.description,
            ),
            status=200,
        )

    async def add_from_rules(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.gateway.config.gateway.max_body_bytes)
        req: AddFromRules = _decode(body, AddFromRules)
        rules = _rules(self.text, req.rules)
        return await self._create(request, _name(req.name), _description(req.description), rules)

    async def add_from_file(self, request: web.Request) -> web.Response:
        limit = self.text.cfg.max_pls_bytes
        form_limit = limit + 64 * 1024
        if request.content_length is not None and request.content_length > form_limit:
            raise APIError(413, "request_too_large", f"the PLS file is over {limit} bytes")
        if not request.content_type.startswith("multipart/form-data"):
            raise _bad("send multipart/form-data with name, file (a PLS lexicon), description")
        reader = await request.multipart()
        fields: dict[str, str] = {}
        data: bytes | None = None
        total = 0
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise _bad("nested multipart bodies are not accepted")
            buf = bytearray()
            while chunk := await part.read_chunk(64 * 1024):
                total += len(chunk)
                buf += chunk
                if total > form_limit or len(buf) > limit:
                    raise APIError(
                        413,
                        "request_too_large",
                        f"the PLS file is over {limit} bytes (text.max_pls_bytes)",
                        param="file",
                    )
            if part.name == "file":
                data = bytes(buf)
            elif part.name in ("name", "description", "workspace_access"):
                try:
                    fields[part.name] = buf.decode("utf-8")
                except UnicodeDecodeError:
                    raise _bad(f"{part.name}: not UTF-8 text", part.name) from None
        if data is None:
            raise _bad("file: the PLS lexicon (a file field) is missing", "file")
        name = _name(fields.get("name"))
        description = _description(fields.get("description"))
        try:
            pls = read_pls(data, max_bytes=limit, max_rules=self.text.cfg.max_dictionary_rules)
        except PlsError as e:
            raise _bad(f"file: {e}", "file", code="invalid_pls") from None
        return await self._create(request, name, description, pls.rules, pls.language)

    def _visible(self, request: web.Request, record: DictionaryRecord | None, did: str) -> Any:
        if record is None or not self.text.visible(record, presented_key(request)):
            raise APIError(
                404,
                "pronunciation_dictionary_not_found",
                f"no pronunciation dictionary {did!r}",
                param="pronunciation_dictionary_id",
            )
        return record

    async def _record(self, request: web.Request) -> DictionaryRecord:
        did = request.match_info["dictionary_id"]
        return self._visible(request, await _run(self.store.get, did), did)  # type: ignore[no-any-return]

    async def get(self, request: web.Request) -> web.Response:
        r = await self._record(request)
        m = _metadata(r)
        return _json(WithRules(**msgspec.structs.asdict(m), rules=r.latest.rules))

    async def listing(self, request: web.Request) -> web.Response:
        key = presented_key(request)
        q = request.query
        try:
            page_size = min(MAX_PAGE, max(1, int(q.get("page_size", "30"))))
            offset = int(q.get("cursor") or "0")
        except ValueError:
            raise _bad("page_size and cursor are integers") from None
        sort: Literal["name", "creation_time_unix"] = (
            "name" if q.get("sort") == "name" else "creation_time_unix"
        )
        descending = q.get("sort_direction", "DESCENDING").upper() != "ASCENDING"
        records = [r for r in await _run(self.store.list) if self.text.visible(r, key)]
        records.sort(
            key=(lambda r: r.name.lower()) if sort == "name" else (lambda r: r.created_at),
            reverse=descending,
        )
        page = records[offset : offset + page_size]
        more = offset + page_size < len(records)
        return _json(
            Listing(
                pronunciation_dictionaries=[_metadata(r) for r in page],
                has_more=more,
                next_cursor=str(offset + page_size) if more else None,
            )
        )

    async def _new_version(
        self, request: web.Request, change: Callable[[list[AliasRule]], list[AliasRule]]
    ) -> web.Response:
        record = await self._record(request)
        cfg = self.text.cfg

        def checked(rules: list[AliasRule]) -> list[AliasRule]:
            out = change(rules)
            if len(out) > cfg.max_dictionary_rules:
                raise RuleError(
                    f"{len(out)} rules; a dictionary holds at most {cfg.max_dictionary_rules}"
                )
            return out

        try:
            record = await _run(
                self.store.new_version, record.id, checked, cfg.max_dictionary_versions
            )
        except NoSuchDictionary:
            self._visible(request, None, record.id)
        except RuleError as e:
            raise _bad(str(e), "rules", code="invalid_rule") from None
        v = record.latest
        return _json(
            RulesChanged(id=record.id, version_id=v.version_id, version_rules_num=len(v.rules))
        )

    async def add_rules(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.gateway.config.gateway.max_body_bytes)
        new = _rules(self.text, _decode(body, RulesBody).rules)

        def change(rules: list[AliasRule]) -> list[AliasRule]:
            # A rule for a string the dictionary has replaces it (ElevenLabs' behaviour).
            replaced = {r.string_to_replace for r in new}
            return [r for r in rules if r.string_to_replace not in replaced] + new

        return await self._new_version(request, change)

    async def set_rules(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.gateway.config.gateway.max_body_bytes)
        new = _rules(self.text, _decode(body, RulesBody).rules)
        return await self._new_version(request, lambda _: new)

    async def remove_rules(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.gateway.config.gateway.max_body_bytes)
        gone = set(_decode(body, RemoveRulesBody).rule_strings)
        return await self._new_version(
            request, lambda rules: [r for r in rules if r.string_to_replace not in gone]
        )

    async def update(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.gateway.config.gateway.max_body_bytes)
        req: UpdateBody = _decode(body, UpdateBody)
        record = await self._record(request)
        if req.archived:
            if any(d.pronunciation_dictionary_id == record.id for d in self.text.defaults):
                raise APIError(
                    409,
                    "dictionary_in_use",
                    f"{record.id!r} is one of the server's default dictionaries "
                    "(text.pronunciation_dictionaries): remove it there first",
                )
            await _run(self.store.delete, record.id)
            m = _metadata(record)
            return _json(msgspec.structs.replace(m, archived_time_unix=int(time.time())))
        if req.name is not None:
            name = _name(req.name)
            try:
                record = await _run(self.store.rename, record.id, name)
            except NoSuchDictionary:
                self._visible(request, None, record.id)
        return _json(_metadata(record))

    async def download(self, request: web.Request) -> web.Response:
        record = await self._record(request)
        vid = request.match_info["version_id"]
        version = record.version(vid)
        if version is None:
            raise APIError(
                404,
                "pronunciation_dictionary_version_not_found",
                f"pronunciation dictionary {record.id!r} has no version {vid!r} "
                "(only the latest versions are kept: text.max_dictionary_versions)",
                param="version_id",
            )
        return web.Response(
            body=write_pls(version.rules, record.language or "en-US"),
            content_type="application/pls+xml",
            headers={
                "Content-Disposition": f'attachment; filename="{record.id}_{vid}.pls"',
            },
        )


def routes(gateway: Gateway) -> list[web.RouteDef]:
    r = _Routes(gateway)
    one = BASE + "/{dictionary_id}"
    handlers: list[tuple[str, str, Handler]] = [
        ("POST", BASE + "/add-from-rules", r.add_from_rules),
        ("POST", BASE + "/add-from-file", r.add_from_file),
        ("GET", BASE, r.listing),
        ("GET", one, r.get),
        ("PATCH", one, r.update),
        ("POST", one + "/add-rules", r.add_rules),
        ("POST", one + "/remove-rules", r.remove_rules),
        ("POST", one + "/set-rules", r.set_rules),
        ("GET", one + "/{version_id}/download", r.download),
    ]
    return [web.route(method, path, handler) for method, path, handler in handlers]
