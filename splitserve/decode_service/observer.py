"""What a decode worker records of each request: spans for its reservation, its admission into
the running batch and its decode stream, and the decode-side request metrics (inter-token and
end-to-end latency as this worker sees them, finish reasons).

    decode.reserve     (SERVER, child of the gateway's Reserve call)
    kv.receive         (SERVER, child of the prefill worker's kv.push; see grpc_transport)
    decode             (SERVER, child of the gateway's Decode call; at its end, the request's
    │                   usage and, if it speculated, `splitserve.spec_decode.*`)
    └── decode.admission   from the Decode call until the request joined the batch
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from opentelemetry.trace import Span, SpanKind

from splitserve.engine.outputs import SpeculationUsage
from splitserve.engine.sampling_params import SamplingParams
from splitserve.protos.v1 import worker_pb2
from splitserve.runtime import genai
from splitserve.runtime.metrics import RequestMetrics
from splitserve.runtime.tracing import Tracing, record_error


class DecodeObserver:
    def __init__(self, tracing: Tracing, requests: RequestMetrics, model: str) -> None:
        self.tracing = tracing
        self.requests = requests
        self.model = model

    @contextmanager
    def reserve(self, request_id: str, context: grpc.ServicerContext) -> Iterator[Span]:
        with self.tracing.span(
            "decode.reserve", self.tracing.extract(context), SpanKind.SERVER
        ) as span:
            if span.is_recording():
                span.set_attribute(genai.REQUEST_ID, request_id)
            yield span

    def reserved(self, span: Span, destination: worker_pb2.KVDestination) -> None:
        if span.is_recording():
            span.set_attribute(genai.KV_NUM_BLOCKS, len(destination.block_ids))
            span.set_attribute(genai.USAGE_CACHED_INPUT_TOKENS, destination.num_cached_tokens)

    def decode(
        self, request_id: str, params: SamplingParams, context: grpc.ServicerContext
    ) -> DecodeObservation:
        span = self.tracing.start("decode", self.tracing.extract(context), SpanKind.SERVER)
        if span.is_recording():
            attributes = genai.request_attributes(self.model, request_id, params, 0)
            del attributes[genai.USAGE_INPUT_TOKENS]  # known once the request finishes
            span.set_attributes(attributes)
        return DecodeObservation(self, span)


class DecodeObservation:
    """One Decode call, from the call to the last output."""

    def __init__(self, observer: DecodeObserver, span: Span) -> None:
        self._observer = observer
        self.span = span
        self.started = time.monotonic()
        self._started_ns = time.time_ns()
        self._last_output: float | None = None

    def admitted(self) -> None:
        """The request joined the running batch (or, prefilling here, the queue)."""
        if self.span.is_recording():
            span = self._observer.tracing.start(
                "decode.admission", self.span, start_time_ns=self._started_ns
            )
            span.end()

    def on_output(self, num_tokens: int = 1) -> None:
        """An output with `num_tokens` new tokens went out. NOTE: the inter-token latency is
        per token, as if a coalesced message's tokens had come evenly spread over its gap."""
        now = time.monotonic()
        gaps = max(1, num_tokens)
        if self._last_output is None:
            gaps, gap = gaps - 1, 0.0  # NOTE: the rest came with the first token
        else:
            gap = (now - self._last_output) / gaps
        for _ in range(gaps):
            self._observer.requests.inter_token_latency.observe(gap)
        self._last_output = now

    def on_finished(
        self, finished: worker_pb2.DecodeFinished, speculation: SpeculationUsage | None = None
    ) -> None:
        """The request finished; `speculation` is what speculative decoding did for it (None:
        nothing was verified, and the span carries no `splitserve.spec_decode.*`)."""
        requests = self._observer.requests
        requests.e2e_request_latency.observe(time.monotonic() - self.started)
        reasons = genai.finish_reason_names(finished.samples)
        requests.finished(reasons[0] if reasons else "unknown")
        if self.span.is_recording():
            self.span.set_attributes(genai.usage_attributes(finished.usage, finished.samples))
            if speculation is not None:
                self.span.set_attributes(genai.speculation_attributes(speculation))

    def end(self, exc: BaseException | None) -> None:
        if exc is not None:
            record_error(self.span, exc)
        self.span.end()
