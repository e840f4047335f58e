"""End to end with tracing on: the real server (vLLM on CPU, tiny model; SNAC's architecture)
exports its spans with the real OTLP/HTTP exporter to a receiver this test runs, and one
request's trace is checked: one trace id (the client's), each process's resource, the parent
links across the gateway, the llm worker and the codec worker, and their order in time.

Run with ``-s`` to see the trace drawn as a tree (docs/operations.md shows one).
"""

from __future__ import annotations

import time
import urllib.request

import pytest
from e2e_harness import Server, child_pid

from testkit.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CLIENT_TRACE = "5b8efff798038103d269b633813fc60c"
CLIENT_SPAN = "eee19b7ec3c1b174"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


EXPECTED = {
    # span: (process role, parent span); gateway.admission only when admission took 5 ms
    "tts.request": ("gateway", None),
    "llm.stream": ("llm", "tts.request"),
    "llm.prefill": ("llm", "llm.stream"),
    "codec.stream": ("codec", "llm.stream"),
    "codec.first_window": ("codec", "codec.stream"),
}


OPTIONAL = {"gateway.admission": ("gateway", "tts.request")}


def draw(spans: dict[str, ReceivedSpan]) -> str:
    """The trace as an indented tree, times relative to the request's start (milliseconds)."""
    t0 = spans["tts.request"].start_ns
    lines = []

    def walk(name: str, depth: int) -> None:
        s = spans[name]
        role = s.resource.get("orpheus.process", "?")
        lines.append(
            f"{'  ' * depth}{name:<{28 - 2 * depth}} {role:<10} "
            f"start {(s.start_ns - t0) / 1e6:8.1f} ms  took {(s.end_ns - s.start_ns) / 1e6:8.1f} ms"
        )
        for event, times in s.events.items():
            at = f"at {(times[0] - t0) / 1e6:8.1f} ms"
            if len(times) > 1:
                at = (
                    f"x{len(times)}, {(times[0] - t0) / 1e6:.1f} .. {(times[-1] - t0) / 1e6:.1f} ms"
                )
            lines.append(f"{'  ' * (depth + 1)}· {event:<{26 - 2 * depth}} {'':<10} {at}")
        children = [c for c, (_, p) in {**EXPECTED, **OPTIONAL}.items() if p == name]
        for child in sorted((c for c in children if c in spans), key=lambda c: spans[c].start_ns):
            walk(child, depth + 1)

    walk("tts.request", 0)
    return "\n".join(lines)


@pytest.fixture
def receiver(otlp_receiver: OtlpReceiver) -> OtlpReceiver:
    return otlp_receiver


@pytest.fixture
def server(default_server: Server) -> Server:
    """The shared server (tests/conftest.py), which exports its spans to ``receiver``."""
    return default_server


def test_one_requests_trace_crosses_the_three_processes(
    server: Server, receiver: OtlpReceiver
) -> None:
    body = b'{"model": "orpheus", "input": "Hello there, traced world.", "voice": "tara", "response_format": "pcm", "max_tokens": 70}'
    req = urllib.request.Request(
        f"{server.url}/v1/audio/speech",
        data=body,
        headers={"Content-Type": "application/json", "traceparent": TRACEPARENT},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        audio = resp.read()
    assert audio

    deadline = time.monotonic() + 30
    while not set(EXPECTED) <= set(receiver.trace(CLIENT_TRACE)) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # nothing else of the trace is on its way
    spans = receiver.trace(CLIENT_TRACE)
    assert set(EXPECTED) <= set(spans) <= set(EXPECTED) | set(OPTIONAL), sorted(spans)
    print("\n" + draw(spans))

    # Each process reports with its own resource.
    orch = server.proc.pid
    for name, (role, parent) in {**EXPECTED, **OPTIONAL}.items():
        if name not in spans:
            continue
        s = spans[name]
        assert s.resource["orpheus.role"] == role, name
        assert s.resource["service.name"] == "orpheus-serve"
        assert s.resource["process.pid"] == child_pid(orch, role), name
        want_parent = CLIENT_SPAN if parent is None else spans[parent].span_id
        assert s.parent_id == want_parent, f"{name}'s parent is {parent or 'the client'}"
        assert s.start_ns <= s.end_ns

    req_span = spans["tts.request"]
    llm, prefill = spans["llm.stream"], spans["llm.prefill"]
    codec, first = spans["codec.stream"], spans["codec.first_window"]
    (first_byte,) = req_span.events["first_audio_byte"]
    # In the order the request went: admitted, submitted, first token, first window, first
    # byte to the client, then each process's span ends.
    admitted_ns = req_span.start_ns + int(req_span.attributes["orpheus.queue_wait_s"] * 1e9)
    assert req_span.start_ns <= admitted_ns <= llm.start_ns + 1_000_000
    if (adm := spans.get("gateway.admission")) is not None:
        assert req_span.start_ns <= adm.start_ns <= adm.end_ns <= llm.start_ns
    assert llm.start_ns <= prefill.end_ns <= first.start_ns <= first.end_ns <= first_byte
    assert llm.start_ns <= codec.start_ns <= first.start_ns
    assert first_byte <= req_span.end_ns
    assert llm.end_ns <= codec.end_ns + 50_000_000  # END travels llm -> codec (clock jitter)

    assert req_span.attributes["orpheus.outcome"] == "ok"
    assert req_span.attributes["orpheus.voice"] == "tara"
    assert req_span.attributes["orpheus.bytes_sent"] == len(audio)
    assert llm.attributes["orpheus.voice"] == "tara"
    assert llm.attributes["orpheus.tokens"] > 0
    assert llm.attributes["orpheus.outcome"] in ("stop", "length")
    assert codec.attributes["orpheus.frames"] == llm.attributes["orpheus.frames"]
    assert "decode_batch" in codec.events
