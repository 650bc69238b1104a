"""A `KVSender` that records each push: a `kv.push` span and the KV transfer metrics.

NOTE: the span is made current only for the duration of the (synchronous) push on the handler's
thread, which is how the inner sender finds the context to put in the push's metadata.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from splitserve.kv_transfer.transport import (
    KVSender,
    Peer,
    Push,
    PushObserver,
    PushResult,
    TransferError,
)
from splitserve.runtime import genai
from splitserve.runtime.tracing import Tracing, record_error


class ObservedSender(KVSender):
    def __init__(self, inner: KVSender, tracing: Tracing, observe: PushObserver) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.tracing = tracing
        self.observe = observe  # the transfer metrics (in the front, for an engine core)

    def endpoint(self) -> dict[str, bytes]:
        return self.inner.endpoint()

    def push(self, peer: Peer, push: Push, timeout_s: float) -> PushResult:
        if not self.tracing.enabled:
            return self._push(peer, push, timeout_s)
        span = self.tracing.start("kv.push", trace.get_current_span(), SpanKind.CLIENT)
        try:
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                start = time.perf_counter()
                result = self._push(peer, push, timeout_s)
            if span.is_recording():
                span.set_attributes(
                    {
                        genai.REQUEST_ID: push.request_id,
                        genai.KV_BYTES: result.num_bytes,
                        genai.KV_NUM_BLOCKS: result.num_blocks,
                        genai.KV_TRANSFER_SECONDS: time.perf_counter() - start,
                        "splitserve.kv.transport": self.inner.name,
                        "server.address": peer.address,
                    }
                )
            return result
        except BaseException as exc:
            record_error(span, exc)
            raise
        finally:
            span.end()

    def _push(self, peer: Peer, push: Push, timeout_s: float) -> PushResult:
        start = time.perf_counter()
        try:
            result = self.inner.push(peer, push, timeout_s)
        except TransferError:
            self.observe(0, 0.0, False)
            raise
        self.observe(result.num_bytes, time.perf_counter() - start, True)
        return result

    def close(self) -> None:
        self.inner.close()
