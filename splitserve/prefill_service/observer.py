"""What a prefill worker records of each request: its span, a child span per engine step that
computed part of the prompt, and the queue and prefill times.

    prefill                      (SERVER, child of the gateway's Prefill call)
    ├── prefill.chunk            tokens [0, 512)      one per engine step that computed some
    ├── kv.push                  blocks 0..31        ─▶ kv.receive on the decode worker
    ├── prefill.chunk            tokens [512, 700)
    └── kv.push                  blocks 32..43

NOTE: the engine does not time its steps for us; the step hook runs after each one, so a chunk
span runs from the previous hook (or the request's arrival) to the hook that saw progress.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, set_span_in_context

from splitserve.engine.sampling_params import SamplingParams
from splitserve.runtime import genai
from splitserve.runtime.metrics import RequestMetrics
from splitserve.runtime.tracing import Tracing, record_error


class PrefillObserver:
    def __init__(self, tracing: Tracing, requests: RequestMetrics, model: str) -> None:
        self.tracing = tracing
        self.requests = requests
        self.model = model

    def start(
        self,
        request_id: str,
        prompt_len: int,
        params: SamplingParams,
        num_cached_tokens: int,
        parent: Context | None,
    ) -> PrefillObservation:
        span = self.tracing.start("prefill", parent, SpanKind.SERVER)
        if span.is_recording():
            span.set_attributes(
                genai.request_attributes(self.model, request_id, params, prompt_len)
            )
            span.set_attribute(genai.USAGE_CACHED_INPUT_TOKENS, num_cached_tokens)
        return PrefillObservation(self, request_id, prompt_len, span)


class PrefillObservation:
    def __init__(
        self, observer: PrefillObserver, request_id: str, prompt_len: int, span: Span
    ) -> None:
        self._observer = observer
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.span = span
        self._arrival_ns = self._last_step_ns = time.time_ns()
        self._first_chunk_ns: int | None = None
        self._num_computed = 0
        self._done = False

    @contextmanager
    def current(self) -> Iterator[None]:
        """Make the request's span current on this thread (kv.push spans start under it)."""
        if not self.span.is_recording():
            yield
            return
        token = otel_context.attach(set_span_in_context(self.span))
        try:
            yield
        finally:
            otel_context.detach(token)

    def on_progress(self, computed: int) -> None:
        """After an engine step that computed prompt tokens of this request (`computed` so
        far): a span for that chunk; queue and prefill time."""
        if self._done:
            return
        now = time.time_ns()
        if computed > self._num_computed:
            self._chunk(self._last_step_ns, now, self._num_computed, computed)
        self._num_computed = computed  # NOTE: drops to 0 on preemption; recompute is traced
        self._last_step_ns = now
        if computed >= self.prompt_len and self._first_chunk_ns is not None:
            self._done = True
            self._observer.requests.request_prefill_time.observe((now - self._first_chunk_ns) / 1e9)

    def _chunk(self, start_ns: int, end_ns: int, first: int, end: int) -> None:
        if self._first_chunk_ns is None:
            self._first_chunk_ns = start_ns
            self._observer.requests.request_queue_time.observe((start_ns - self._arrival_ns) / 1e9)
        if not self.span.is_recording():
            return
        chunk = self._observer.tracing.start(
            "prefill.chunk",
            self.span,
            start_time_ns=start_ns,
            attributes={
                "splitserve.chunk.first_token": first,
                "splitserve.chunk.end_token": end,
                "splitserve.chunk.num_tokens": end - first,
            },
        )
        chunk.end(end_time=end_ns)

    def finish(self, num_blocks: int, num_bytes: int) -> None:
        if self.span.is_recording():
            self.span.set_attribute(genai.KV_BYTES, num_bytes)
            self.span.set_attribute(genai.KV_NUM_BLOCKS, num_blocks)

    def end(self, exc: BaseException | None) -> None:
        if exc is not None:
            record_error(self.span, exc)
        self.span.end()
