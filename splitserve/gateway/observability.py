"""What the gateway records of each request: its span (the root of the request's trace, unless
the client sent a `traceparent`), a client span around each call to a worker, and the request
metrics: time to first token, inter-token latency, end-to-end latency, finish reasons and the
routing decisions.

    text_completion <model>                       (gateway, SERVER)
    ├── splitserve.v1.DecodeWorker/Reserve        (CLIENT) ─▶ decode.reserve on D
    ├── splitserve.v1.PrefillWorker/Prefill       (CLIENT) ─▶ prefill on P ─▶ kv.push ─▶ kv.receive
    └── splitserve.v1.DecodeWorker/Decode         (CLIENT) ─▶ decode on D
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanKind

from splitserve.gateway.validation import Job
from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.protos.v1 import gateway_pb2, worker_pb2
from splitserve.runtime import genai
from splitserve.runtime.metrics import RequestMetrics, RoutingMetrics
from splitserve.runtime.tracing import Metadata, Tracing, record_error

RESERVE = "splitserve.v1.DecodeWorker/Reserve"
PREFILL = "splitserve.v1.PrefillWorker/Prefill"
DECODE = "splitserve.v1.DecodeWorker/Decode"


@dataclass(frozen=True)
class CallSpan:
    """A call to a worker: its span, and the metadata that carries it to the worker."""

    span: Span
    metadata: Metadata | None

    def fail(self, exc: BaseException) -> None:
        """Mark a failure that the caller handles (e.g. by retrying elsewhere)."""
        record_error(self.span, exc)


class GatewayObserver:
    def __init__(
        self, tracing: Tracing, requests: RequestMetrics, routing: RoutingMetrics, model: str
    ) -> None:
        self.tracing = tracing
        self.requests = requests
        self.routing = routing
        self.model = model

    def start(self, job: Job, context: grpc.ServicerContext) -> RequestObservation:
        span = self.tracing.start(
            f"{genai.OPERATION_NAME} {self.model}", self.tracing.extract(context), SpanKind.SERVER
        )
        if span.is_recording():
            span.set_attributes(
                genai.request_attributes(
                    self.model, job.request_id, job.params, len(job.prompt_token_ids)
                )
            )
        return RequestObservation(self, span)


class RequestObservation:
    """One Generate call, from validation to its last message."""

    def __init__(self, observer: GatewayObserver, span: Span) -> None:
        self._observer = observer
        self.span = span
        self.started = time.monotonic()
        self._last_output: float | None = None

    def routed(self, kind: str, worker_id: str, reason: str) -> None:
        self._observer.routing.decided(kind, reason)
        if self.span.is_recording():
            self.span.set_attribute(f"splitserve.route.{kind}_worker", worker_id)
            self.span.set_attribute(f"splitserve.route.{kind}_reason", reason)

    @contextmanager
    def call(self, method: str, worker: WorkerInfo) -> Iterator[CallSpan]:
        """A client span around a call to `worker` for the body of a `with`."""
        tracing = self._observer.tracing
        span = tracing.start(method, self.span, SpanKind.CLIENT)
        if span.is_recording():
            service, _, name = method.partition("/")
            span.set_attributes(
                {
                    "rpc.system": "grpc",
                    "rpc.service": service,
                    "rpc.method": name,
                    "server.address": worker.address,
                    genai.WORKER_ID: worker.worker_id,
                }
            )
        try:
            yield CallSpan(span, tracing.metadata(span))
        except BaseException as exc:
            record_error(span, exc)
            raise
        finally:
            span.end()

    def migrated(
        self, lost: WorkerInfo, to: WorkerInfo, reason: str, num_tokens: int, kv: str
    ) -> None:
        """The Decode stream moved from `lost` to `to` after `num_tokens` tokens, its KV
        `kv` (handed_off or recomputed): a span event and `splitserve:stream_migrations`."""
        self._observer.routing.migrated(reason, kv)
        if self.span.is_recording():
            self.span.add_event(
                "splitserve.stream_migrated",
                {
                    "splitserve.migration.from_worker": lost.worker_id,
                    "splitserve.migration.to_worker": to.worker_id,
                    "splitserve.migration.reason": reason,
                    "splitserve.migration.num_tokens": num_tokens,
                    "splitserve.migration.kv": kv,
                },
            )
            self.span.set_attribute("splitserve.route.decode_worker", to.worker_id)

    def prefilled(self, response: worker_pb2.PrefillResponse) -> None:
        if self.span.is_recording():
            self.span.set_attribute(genai.KV_BYTES, response.num_bytes_sent)
            self.span.set_attribute(genai.KV_NUM_BLOCKS, response.num_blocks_sent)

    def on_chunk(self, num_tokens: int = 1) -> None:
        """A message of `num_tokens` new tokens went out. NOTE: the inter-token latency is
        per token, as if a coalesced message's tokens had come evenly spread over its gap."""
        now = time.monotonic()
        metrics = self._observer.requests
        gaps = max(1, num_tokens)
        if self._last_output is None:
            ttft = now - self.started
            metrics.time_to_first_token.observe(ttft)
            if self.span.is_recording():
                self.span.set_attribute(genai.TIME_TO_FIRST_TOKEN, ttft)
            gaps -= 1  # NOTE: the first token's wait is the TTFT; the rest came with it
            gap = 0.0
        else:
            gap = (now - self._last_output) / gaps
        for _ in range(gaps):
            metrics.inter_token_latency.observe(gap)
        self._last_output = now

    def on_finished(self, finished: gateway_pb2.Finished) -> None:
        metrics = self._observer.requests
        metrics.e2e_request_latency.observe(time.monotonic() - self.started)
        reasons = genai.finish_reason_names(finished.samples)
        metrics.finished(reasons[0] if reasons else "unknown")
        if self.span.is_recording():
            self.span.set_attributes(genai.usage_attributes(finished.usage, finished.samples))

    def end(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            record_error(self.span, exc)
        self.span.end()
