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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

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

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(self.retry_after_s)}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.code!r}, {self.message!r})"
