"""What a front (load balancer, ingress) must let through to a node, from the server's own
code and configuration (the shipped production TOML): the largest request body of each POST
route and the longest a node stays silent on a request or socket it still serves. Used by the
checks of deploy/multinode/ (tests/deploy/test_deploy_files.py) and deploy/kubernetes/
(tests/deploy/test_kubernetes.py)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from common.config import ServeConfig
from orchestrator.settings import load_config

if TYPE_CHECKING:
    from gateway.service import Gateway

PROD_TOML = Path(__file__).resolve().parents[2] / "deploy" / "config" / "orpheus-serve.toml"
ELEVENLABS_MAX_INACTIVITY_S = 180.0
"""ElevenLabs' ``inactivity_timeout`` query parameter is capped here (gateway/frontends/elevenlabs/websocket.py,
docs/api.md): the longest a node keeps an idle ElevenLabs socket open."""
VOICE_UPLOAD = "/v1/audio/voices"
DETECT = "/v1/watermark/detect"
"""The watermark detector: an audio file, bounded like a voice upload."""


@cache
def prod_config() -> ServeConfig:
    return load_config(str(PROD_TOML), None, {})


def longest_node_silence_s() -> float:
    """A queued request's wait for its first byte, a stream's gap before it fails, a voice
    upload's encode, the WebSocket ping interval and the idle-socket closes: a front's read
    and idle timeouts must be longer."""
    from gateway.frontends.utterance import WS_HEARTBEAT_S

    cfg = prod_config()
    g = cfg.gateway
    return max(
        g.queue_timeout_s,
        g.upstream_idle_timeout_s,
        g.ws_start_timeout_s,
        g.ws_text_idle_timeout_s,
        ELEVENLABS_MAX_INACTIVITY_S,
        WS_HEARTBEAT_S,
        cfg.voices.encode_timeout_s,
    )


def routes_only_gateway() -> Gateway:
    """What ``build_app`` reads of a gateway to lay out its routes (no process behind it):
    the tests that check the routes against the deploy files share this one stand-in."""
    return SimpleNamespace(  # type: ignore[return-value]
        config=ServeConfig(),
        custom_voices=None,
        voices=SimpleNamespace(listing=None),
        metrics=None,
        tracing=None,
        cache=SimpleNamespace(shared=False),  # the sentence audio cache's routes (on by default)
    )


@cache
def body_limits() -> dict[str, int]:
    """The largest body the gateway takes on each of its POST routes (its own routes):
    voices.max_upload_bytes for custom-voice uploads, gateway.max_body_bytes for every other."""
    from gateway.app import build_app

    cfg = prod_config()
    app = build_app(routes_only_gateway())
    posts = {r.resource.canonical for r in app.router.routes() if r.method == "POST"}
    assert VOICE_UPLOAD in posts and "/v1/audio/speech" in posts
    big = {VOICE_UPLOAD: cfg.voices.max_upload_bytes, DETECT: cfg.voices.max_upload_bytes}
    return {path: big.get(path, cfg.gateway.max_body_bytes) for path in sorted(posts)}


def nginx_size(value: str) -> int:
    """An nginx size ("128k", "17m")."""
    units = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
    m = re.fullmatch(r"(\d+)([kmg]?)", value.lower())
    assert m, value
    return int(m.group(1)) * units[m.group(2)]
