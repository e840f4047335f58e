"""API errors: one exception type that every front end (HTTP, WebSocket, ZeroMQ) renders.

The JSON shape is OpenAI's: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import msgspec

from shm.records import StreamError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorDetail


class ElevenLabsDetail(msgspec.Struct, frozen=True):
    status: str
    message: str


class ElevenLabsErrorBody(msgspec.Struct, frozen=True):
    """ElevenLabs' error shape, ``{"detail": {"status", "message"}}``."""

    detail: ElevenLabsDetail


ELEVENLABS_BUSY = {"too_many_concurrent_requests": "too_many_concurrent_requests"}
"""Admission's 429 codes as ElevenLabs names them; every other 429 is ``system_busy`` (the
node is full: back off), as ElevenLabs' clients expect."""


class APIError(Exception):
    """A request failed in a way the client should hear about, with an HTTP status."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.extra_headers = headers
        """Headers the answer carries besides ``Retry-After`` (admission's 429s: the
        concurrency counts ElevenLabs clients read)."""

    @classmethod
    def from_stream_error(cls, err: StreamError) -> APIError:
        status = err.status if 400 <= err.status <= 599 else 500
        return cls(status, err.code, err.message, retry_after_s=err.retry_after_s)

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "server_error" if self.status >= 500 else "error")

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.body())

    def to_elevenlabs_json(self) -> bytes:
        """The body ElevenLabs' clients read: their overload statuses on a 429
        (``detail.status``), this error's code otherwise."""
        status = self.code
        if self.status == 429:
            status = ELEVENLABS_BUSY.get(self.code, "system_busy")
        return msgspec.json.encode(ElevenLabsErrorBody(ElevenLabsDetail(status, self.message)))

    def headers(self) -> dict[str, str]:
        out = dict(self.extra_headers) if self.extra_headers else {}
        if self.retry_after_s is not None:
            out["Retry-After"] = str(self.retry_after_s)
        return out

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.code!r}, {self.message!r})"
