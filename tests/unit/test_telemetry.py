"""Tracing settings from OTEL_* variables, the no-op path when tracing is off, trace context
carried through gRPC metadata, and per-process metrics that export only what they measure."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN
from prometheus_client import generate_latest

from splitserve.runtime.metrics import KVTransferMetrics, Metrics, RequestMetrics
from splitserve.runtime.settings import TracingSettings
from splitserve.runtime.tracing import Tracing, make_tracing


class FakeContext:
    """The part of grpc.ServicerContext that `Tracing.extract` reads."""

    def __init__(self, metadata) -> None:
        self.metadata = tuple(metadata or ())
        self.reads = 0

    def invocation_metadata(self):
        self.reads += 1
        return self.metadata


def test_tracing_is_off_unless_otel_traces_exporter_names_an_exporter():
    assert not TracingSettings.from_env({}).enabled
    assert not TracingSettings.from_env({"OTEL_TRACES_EXPORTER": "none"}).enabled
    off = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}
    assert not TracingSettings.from_env(off).enabled
    on = TracingSettings.from_env(
        {
            "OTEL_TRACES_EXPORTER": "otlp,console",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_SERVICE_NAME": "gw",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
    )
    assert on.exporters == ("otlp", "console") and on.endpoint == "http://collector:4317"
    assert on.insecure is True and on.service_name == "gw" and on.schedule_delay_ms == 100.0


def test_unsupported_exporter_or_protocol_is_a_clear_error():
    with pytest.raises(ValueError, match="zipkin"):
        TracingSettings.from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="only grpc"):
        TracingSettings.from_env(
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        )


def test_disabled_tracing_records_nothing_and_reads_no_metadata():
    tracing = make_tracing(TracingSettings(), "gateway", "gw-1")
    assert not tracing.enabled
    context = FakeContext([("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")])
    assert tracing.extract(context) is None and context.reads == 0
    span = tracing.start("anything", None)
    assert span is INVALID_SPAN and not span.is_recording()
    assert tracing.metadata(span) is None


def test_trace_context_crosses_grpc_metadata_to_a_child_span():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider.get_tracer("test"), provider)
    parent = tracing.start("caller", None)
    metadata = tracing.metadata(parent)
    assert metadata is not None and dict(metadata)["traceparent"]
    with tracing.span("callee", tracing.extract(FakeContext(metadata))):
        pass
    parent.end()
    callee, caller = exporter.get_finished_spans()
    assert callee.context.trace_id == caller.context.trace_id
    assert callee.parent is not None and callee.parent.span_id == caller.context.span_id


def test_metrics_live_on_their_own_registry_with_model_name_and_only_what_is_measured():
    metrics = Metrics("my-model")
    requests = RequestMetrics(metrics, ("time_to_first_token",), outcomes=True)
    requests.time_to_first_token.observe(0.2)
    requests.inter_token_latency.observe(0.1)  # not measured here: not exported
    requests.finished("stop")
    KVTransferMetrics(metrics).observe(4096, 0.01, ok=True)
    text = generate_latest(metrics.registry).decode()
    assert 'splitserve:time_to_first_token_seconds_count{model_name="my-model"} 1.0' in text
    assert "inter_token_latency" not in text
    assert 'splitserve:request_success_total{finished_reason="stop",model_name="my-model"}' in text
    assert 'splitserve:kv_transfer_bytes_total{model_name="my-model"} 4096.0' in text
    assert "splitserve" not in generate_latest().decode()  # the global registry is untouched
    with pytest.raises(ValueError, match="unknown"):
        RequestMetrics(Metrics("m"), ("time_to_first_tokens",), outcomes=False)
