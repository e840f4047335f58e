"""OpenTelemetry tracing: whether it is on, and the process's tracer when it is.

Off by default. On when the standard variables say so (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set) or the config key ``otlp_traces_endpoint`` is
set, and ``OTEL_SDK_DISABLED`` is not true. Everything else is the SDK's own configuration,
read from the standard variables as in any OpenTelemetry service: the protocol
(``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``: ``http/protobuf``, the default, or ``grpc``),
headers, timeout, the sampler (``OTEL_TRACES_SAMPLER[_ARG]``), the batch processor
(``OTEL_BSP_SCHEDULE_DELAY``, ...), ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``.

``setup_tracing`` returns ``None`` when tracing is off, and imports nothing of OpenTelemetry
then: the processes' hooks are ``if tracing is not None`` tests, so tracing off costs nothing
on the hot path. When on it returns a :class:`Tracing`, built with the process's resource
(``service.name``, ``process.pid``, ``orpheus.role``: gateway, llm or codec, and
``orpheus.process``: ``gateway-1``, ``llm-0``, ...).

A request's trace context travels with the request as a W3C ``traceparent`` string: in
``LlmSubmit.traceparent`` (gateway -> llm worker) and in the code ring's ``START`` record
(llm worker -> codec worker, ``shm.records.StreamStart``). docs/operations.md shows a trace.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
DEFAULT_SERVICE_NAME = "orpheus-serve"
ROLES = ("gateway", "llm", "codec")


class TracingConfigError(ValueError):
    """The tracing variables name something this server cannot do (one line says what)."""


def tracing_enabled(
    configured_endpoint: str = "", environ: Mapping[str, str] | None = None
) -> bool:
    """Whether this process traces: an endpoint is given (config key or standard variable)
    and ``OTEL_SDK_DISABLED`` is not ``true``."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(configured_endpoint) or any(env.get(v, "").strip() for v in ENDPOINT_VARS)


def traces_protocol(environ: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol for traces: the traces variable, else the general one, else
    ``http/protobuf`` (the specification's default)."""
    env = os.environ if environ is None else environ
    for var in PROTOCOL_VARS:
        if value := env.get(var, "").strip():
            if value not in ("http/protobuf", "grpc"):
                raise TracingConfigError(
                    f"{var}={value!r}: this server exports traces over 'http/protobuf' or 'grpc'"
                )
            return value
    return "http/protobuf"


class Tracing:
    """The process's tracer and the W3C trace-context codec (only built when tracing is on).

    Spans are the SDK's own objects: callers end them, add events and attributes to them."""

    __slots__ = ("_in_context", "_kinds", "_propagator", "provider", "role", "tracer")

    def __init__(self, provider: TracerProvider, role: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.role = role
        self.tracer: Tracer = provider.get_tracer("orpheus_serve")
        self._propagator = TraceContextTextMapPropagator()
        self._in_context = trace.set_span_in_context
        self._kinds = (trace.SpanKind.INTERNAL, trace.SpanKind.SERVER)

    def start(
        self,
        name: str,
        traceparent: str | None = None,
        *,
        parent: Span | None = None,
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
        server: bool = False,
    ) -> Span:
        """A span continuing ``parent`` (a span of this process) or else ``traceparent`` (a
        W3C header from elsewhere; malformed or missing: a new trace is started)."""
        if parent is not None:
            context = self._in_context(parent)
        elif traceparent:
            context = self._propagator.extract({"traceparent": traceparent})
        else:
            context = None
        return self.tracer.start_span(
            name,
            context=context,
            kind=self._kinds[server],
            attributes=attributes,
            start_time=start_ns,
        )

    def traceparent(self, span: Span) -> str:
        """``span``'s context as a W3C ``traceparent`` value (sampled or not: the next process
        follows this process's sampling decision)."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(span))
        return carrier.get("traceparent", "")

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter (the process ends)."""
        self.provider.shutdown()


def setup_tracing(
    role: str, configured_endpoint: str = "", environ: Mapping[str, str] | None = None
) -> Tracing | None:
    """The process's :class:`Tracing`, or ``None`` when tracing is off (nothing imported)."""
    env = os.environ if environ is None else environ
    if not tracing_enabled(configured_endpoint, env):
        return None
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {ROLES}")
    protocol = traces_protocol(env)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The standard variables win; the config key is the endpoint when none is given.
    endpoint = None if any(env.get(v, "").strip() for v in ENDPOINT_VARS) else configured_endpoint
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    resource = Resource.create(
        {
            "service.name": env.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME,
            "process.pid": os.getpid(),
            "orpheus.role": role,
            "orpheus.process": env.get("ORPHEUS_SERVE_ROLE", role),
        }
    )
    # The sampler (OTEL_TRACES_SAMPLER) and the batch processor (OTEL_BSP_*) read the
    # standard variables themselves.
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, role)
