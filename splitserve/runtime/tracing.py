"""Tracing: one OpenTelemetry tracer per process (a no-op one unless OTEL_TRACES_EXPORTER
names an exporter), and W3C trace context (`traceparent`) carried in gRPC metadata.

    gateway ─ metadata: traceparent ─▶ prefill ─ PushBlocks metadata ─▶ decode (kv.receive)
            ─ metadata: traceparent ─▶ decode (reserve, decode)

NOTE: spans are started with explicit parents, never "the current span": streaming handlers
are (async) generators, and a context attached in one would leak into whatever iterates it
between two of its messages. Callers check `span.is_recording()` before building attributes, so
that with tracing off a request pays for nothing but a few no-op calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.runtime.settings import TracingSettings

INSTRUMENTATION_NAME = "splitserve"
Metadata = Sequence[tuple[str, str]]


class Tracing:
    """A process's tracer and the propagation of its context across gRPC calls."""

    def __init__(self, tracer: trace.Tracer, provider: TracerProvider | None = None) -> None:
        self.tracer = tracer
        self._provider = provider
        self._propagator = TraceContextTextMapPropagator()
        # How it was made (settings, service, instance), so that a worker's engine core
        # process can make its own with the same resource; None: disabled or made by hand.
        self.origin: tuple[TracingSettings, str, str] | None = None

    def carrier(self, span: Span) -> dict[str, str]:
        """`span`'s context as W3C headers, to hand to another process of this service."""
        carrier: dict[str, str] = {}
        if span.is_recording():
            self._propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier

    def from_carrier(self, carrier: dict[str, str]) -> Context | None:
        return self._propagator.extract(carrier) if carrier else None

    @classmethod
    def disabled(cls) -> Tracing:
        return cls(trace.NoOpTracer())

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def extract(self, context: grpc.ServicerContext) -> Context | None:
        """The caller's trace context from a call's metadata (None with tracing off)."""
        if self._provider is None:
            return None
        carrier = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        return self._propagator.extract(carrier)

    def metadata(self, span: Span) -> Metadata | None:
        """gRPC metadata that makes `span` the parent of the callee's spans."""
        if not span.is_recording():
            return None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return tuple(carrier.items())

    def start(
        self,
        name: str,
        parent: Context | Span | None,
        kind: SpanKind = SpanKind.INTERNAL,
        start_time_ns: int | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> Span:
        """A span under `parent` (a span, or a context from `extract`); the caller ends it."""
        if self._provider is None:
            return INVALID_SPAN
        if isinstance(parent, Span):
            parent = trace.set_span_in_context(parent)
        elif parent is None:
            parent = Context()  # a new trace, whatever this thread happens to have attached
        return self.tracer.start_span(
            name, context=parent, kind=kind, start_time=start_time_ns, attributes=attributes
        )

    @contextmanager
    def span(
        self, name: str, parent: Context | Span | None, kind: SpanKind = SpanKind.INTERNAL
    ) -> Iterator[Span]:
        """A span for the body of a `with`; an exception marks it failed."""
        span = self.start(name, parent, kind)
        try:
            yield span
        except BaseException as exc:
            record_error(span, exc)
            raise
        finally:
            span.end()

    def shutdown(self) -> None:
        """Export what is still buffered, then stop."""
        if self._provider is not None:
            self._provider.shutdown()


def record_error(span: Span, exc: BaseException) -> None:
    if not span.is_recording():
        return
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        span.set_status(Status(StatusCode.ERROR, "cancelled by the caller"))
        return
    code = getattr(exc, "code", None)
    if isinstance(exc, grpc.RpcError) and callable(code):
        span.set_attribute("rpc.grpc.status_code", code().value[0])
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def _exporter(name: str, settings: TracingSettings) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=settings.endpoint or None, insecure=settings.insecure)


def make_tracing(settings: TracingSettings, service: str, instance_id: str) -> Tracing:
    """The tracing of one service process; a no-op tracer when `settings` enable none."""
    if not settings.enabled:
        return Tracing.disabled()
    resource = Resource.create(
        {
            "service.name": settings.service_name or f"splitserve-{service}",
            "service.namespace": "splitserve",
            "service.instance.id": instance_id,
        }
    )
    provider = TracerProvider(resource=resource)
    for name in settings.exporters:
        provider.add_span_processor(
            BatchSpanProcessor(
                _exporter(name, settings), schedule_delay_millis=settings.schedule_delay_ms
            )
        )
    tracing = Tracing(provider.get_tracer(INSTRUMENTATION_NAME), provider)
    tracing.origin = (settings, service, instance_id)
    return tracing
