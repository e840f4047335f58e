"""ElevenLabs' multi-context WebSocket as the gateway's tests speak it: the path, and the
messages received per context (audio, alignment, finals, errors)."""

from __future__ import annotations

import base64
import json
from collections import defaultdict
from typing import Any

import aiohttp


def ws_path(voice: str = "tara", fmt: str = "pcm_24000") -> str:
    return f"/v1/text-to-speech/{voice}/multi-stream-input?model_id=eleven_flash_v2_5&output_format={fmt}&auto_mode=true&sync_alignment=true"


class Received:
    def __init__(self) -> None:
        self.audio: dict[str, bytearray] = defaultdict(bytearray)
        self.messages: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
        self.final: list[str] = []
        self.errors: list[dict[str, Any]] = []

    def add(self, m: dict[str, Any]) -> None:
        cid = m.get("contextId")
        if "error" in m:
            self.errors.append(m)
        elif m.get("isFinal"):
            self.final.append(cid)
        else:
            assert cid not in self.final, "audio after isFinal"
            if m.get("audio"):
                self.audio[cid] += base64.b64decode(m["audio"])
            self.messages[cid].append(m)


async def receive_until(
    ws: aiohttp.ClientWebSocketResponse, r: Received, done: Any, timeout: float = 20.0
) -> None:
    while not done():
        msg = await ws.receive(timeout)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        r.add(json.loads(msg.data))
