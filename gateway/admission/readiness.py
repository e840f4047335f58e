"""Whether a gateway can take a new stream: the body of ``GET /ready`` and the refusal that
admission gives while it cannot (draining, workers not ready).

Both read the same state: the orchestrator's last ``ClusterStatus``, whether this gateway
is draining, and (for ``/ready``) the node's admission counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gateway.errors import APIError
from shm.messages import ClusterStatus

if TYPE_CHECKING:
    from gateway.admission.queue import Admission


class Readiness(msgspec.Struct, frozen=True):
    """Body of ``GET /ready``."""

    ready: bool
    reasons: list[str]
    active_streams: int
    queued_streams: int
    max_active_streams: int
    """The streams the node can hold now: its ready engines' shares."""
    draining: bool
    engines_ready: int = 0
    """vLLM engines ready (a stream is placed on one of them)."""
    engines: int = 0
    """vLLM engines configured (``llm.engines``)."""


def background_room(admission: Admission, reserve: int, draining: bool) -> tuple[bool, int]:
    """Whether background work (a long-form job's unit, a cache warm-up) may start a stream
    now: the node has a slot beyond ``reserve`` interactive ones (learned admission: at most
    half of what it holds in real time, so that a small node still works while nobody
    talks), nobody waits for a slot, and this gateway is not draining. Also: the reserve's
    slots that interactive streams hold (the jobs' metric)."""
    active, queued = admission.node_counts()
    capacity = admission.capacity()
    if admission.learned:
        reserve = min(reserve, capacity // 2)
    limit = capacity - reserve
    in_use = max(0, min(active - limit, capacity))
    return queued == 0 and active < limit and not draining, in_use


def draining_error(retry_after_s: int) -> APIError:
    return APIError(
        503,
        "draining",
        "the server is shutting down; retry on another instance",
        retry_after_s=retry_after_s,
    )


def refusal(status: ClusterStatus | None, draining: bool, retry_after_s: int) -> APIError | None:
    """Why admission must refuse a new stream now (503), or None: the admission gate."""
    if draining or (status is not None and status.draining):
        return draining_error(retry_after_s)
    if status is None or not (status.llm_ready and status.codec_ready):
        # With several engines one ready engine is enough: streams are placed on it.
        return APIError(
            503,
            "workers_not_ready",
            "the model workers are not ready yet",
            retry_after_s=retry_after_s,
        )
    return None


def readiness(
    status: ClusterStatus | None,
    draining: bool,
    node_counts: tuple[int, int],
    max_active: int,
) -> Readiness:
    """``/ready``: ready when every worker is warm, nothing drains and a slot is free.
    ``node_counts``: the node's (active, queued) streams, over every gateway."""
    reasons: list[str] = []
    if status is None:
        reasons.append("no status from the orchestrator yet")
    else:
        if not status.llm_ready:
            reasons.append(
                "llm_worker not ready"
                if len(status.engines) == 1
                else f"none of the {len(status.engines)} llm engines ready"
            )
        if not status.codec_ready:
            reasons.append("codec_worker not ready")
        if status.draining:
            reasons.append("instance draining")
    if draining:
        reasons.append("gateway draining")
    active, queued = node_counts
    if active >= max_active:
        reasons.append(f"all {max_active} stream slots busy")
    return Readiness(
        ready=not reasons,
        reasons=reasons,
        active_streams=active,
        queued_streams=queued,
        max_active_streams=max_active,
        draining=draining,
        engines_ready=0 if status is None else sum(status.ready_engines),
        engines=0 if status is None else len(status.engines),
    )
