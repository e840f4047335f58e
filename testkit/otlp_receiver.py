"""An OTLP/HTTP traces receiver on loopback (``POST /v1/traces``, protobuf, gzip or not), as an
OpenTelemetry collector answers: the end-to-end tracing test keeps and reads the spans it gets,
``bench gateway --tracing`` only counts them (the exporter's cost is what is measured, not a
collector's).

    with OtlpReceiver(keep=True) as r:   # r.url: OTEL_EXPORTER_OTLP_ENDPOINT
        ...
        r.spans                          # ReceivedSpan, in arrival order

As a command, a receiver that counts and drops until SIGINT/SIGTERM (the whole-server side by
side, ``bench compare --serve-arg=--set=otlp_traces_endpoint=http://127.0.0.1:4318/v1/traces``)::

    python -m testkit.otlp_receiver --port 4318
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_REPLY = ExportTraceServiceResponse().SerializeToString()


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    """Hex; empty for a root span."""
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: dict[str, list[int]]
    """Event name -> the times it occurred (ns), in order."""
    resource: dict[str, Any]


class OtlpReceiver:
    """A threaded HTTP server; ``keep=False`` counts the spans and drops them."""

    def __init__(self, keep: bool = True, port: int = 0) -> None:
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.span_count = 0
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    receiver._take(ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(_REPLY)))
                self.end_headers()
                self.wfile.write(_REPLY)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        """The base URL (``OTEL_EXPORTER_OTLP_ENDPOINT``); traces go to ``url + "/v1/traces"``."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )
        self._thread.start()

    def _take(self, req: ExportTraceServiceRequest) -> None:
        got: list[ReceivedSpan] = []
        count = 0
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                count += len(ss.spans)
                if not self.keep:
                    continue
                for s in ss.spans:
                    events: dict[str, list[int]] = {}
                    for e in s.events:
                        events.setdefault(e.name, []).append(e.time_unix_nano)
                    attributes = {a.key: _value(a.value) for a in s.attributes}
                    ids = (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                    times = (s.start_time_unix_nano, s.end_time_unix_nano)
                    got.append(ReceivedSpan(s.name, *ids, *times, attributes, events, resource))
        with self._lock:
            self.posts += 1
            self.span_count += count
            self.spans.extend(got)

    def trace(self, trace_id: str) -> dict[str, ReceivedSpan]:
        """The spans of one trace received so far, by name."""
        with self._lock:
            return {s.name: s for s in self.spans if s.trace_id == trace_id}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="python -m testkit.otlp_receiver", description=__doc__)
    ap.add_argument("--port", type=int, default=4318, help="loopback port (4318: OTLP/HTTP's)")
    args = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with OtlpReceiver(keep=False, port=args.port) as r:
        print(f"OTLP/HTTP receiver at {r.url}/v1/traces", flush=True)
        stop.wait()
        print(f"received {r.span_count} spans in {r.posts} exports", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
