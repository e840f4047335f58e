"""The ``api`` label: which front end served a request (``Api``).

Its own module so that a front end names its label without importing ``gateway.metrics``:
what reaches the metrics from a front end goes through its ``ClientLink``
(``gateway.link``) and its requests (``gateway.requests``), nowhere else (.importlinter).
"""

from __future__ import annotations

from enum import StrEnum


class Api(StrEnum):
    """The ``api`` label: which front end served a request. The values are exported (dashboards
    and alerts select on them) and stay as they are; the names say what they mean."""

    OPENAI_HTTP = "http"
    OPENAI_SSE = "sse"
    OMNI = "ws"
    """vLLM-Omni's streaming WebSocket (the label predates the other WebSocket protocols)."""
    ZMQ = "zmq"
    ELEVENLABS = "elevenlabs"
    BASETEN = "baseten"
    JOBS = "jobs"
    """A unit of a long-form job (``gateway.jobs``), spoken in the engines' spare capacity."""


APIS = tuple(a.value for a in Api)
