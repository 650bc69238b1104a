"""KV transfer over gRPC: a client-streaming PushBlocks of one header and <= 1 MiB data chunks.

sender (prefill)                                 receiver (decode)
GrpcKVTransport.send ── header ───────────────▶  validate header, check_push (fence)
                     ── data[0..1 MiB) ───────▶  append (never past payload_bytes)
                     ── data ... ─────────────▶
                     ◀── PushBlocksResponse ──  size + CRC-32C, then receiver.on_blocks

The push carries the sender's current trace context (W3C `traceparent` metadata); a servicer
given a tracer records a `kv.receive` span under it, and reports every push to `on_push`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.kv_transfer.transport import KVReceiver, KVTransport, PushResult, TransferError
from splitserve.kv_transfer.wire import (
    MAX_CHUNK_BYTES,
    Buffer,
    KVTransferError,
    PushRefused,
    split_payload,
    validate_header,
    verify_payload,
)
from splitserve.protos.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)

# A data message is <= 1 MiB plus framing; the headroom lets a future larger header through.
MAX_MESSAGE_BYTES = 4 * MAX_CHUNK_BYTES
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
"""Options for channels and servers that carry KVTransfer."""

PushObserver = Callable[[int, float, bool], None]
"""Told of every push a servicer handles: (payload bytes, seconds, whether it landed)."""


class GrpcKVTransport(KVTransport):
    """Pushes blocks over one cached insecure channel per receiver address."""

    def __init__(self, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        if not 0 < max_chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]")
        self.max_chunk_bytes = max_chunk_bytes
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, kv_transfer_pb2_grpc.KVTransferStub]] = {}
        self._closed = False
        self._propagator = TraceContextTextMapPropagator()

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        with self._lock:
            if self._closed:
                raise RuntimeError("GrpcKVTransport is closed")
            entry = self._channels.get(address)
            if entry is None:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                entry = (channel, kv_transfer_pb2_grpc.KVTransferStub(channel))
                self._channels[address] = entry
            return entry[1]

    def _messages(
        self, header: kv_transfer_pb2.KVTransferHeader, payload: Buffer
    ) -> Iterator[kv_transfer_pb2.KVTransferMessage]:
        yield kv_transfer_pb2.KVTransferMessage(header=header)
        for chunk in split_payload(payload, self.max_chunk_bytes):
            # NOTE: protobuf bytes fields take bytes only, so each chunk is copied once here.
            yield kv_transfer_pb2.KVTransferMessage(data=bytes(chunk))

    def send(
        self,
        address: str,
        header: kv_transfer_pb2.KVTransferHeader,
        payload: Buffer,
        timeout_s: float,
    ) -> PushResult:
        """Push `payload` to the KVTransfer server at `address` ("host:port")."""
        if len(payload) != header.payload_bytes:
            raise ValueError(
                f"payload is {len(payload)} bytes but the header declares {header.payload_bytes}"
            )
        stub = self._stub(address)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)  # nothing unless a recording span is current
        try:
            response = stub.PushBlocks(
                self._messages(header, payload),
                timeout=timeout_s,
                metadata=tuple(carrier.items()) or None,
            )
        except grpc.RpcError as exc:
            code: grpc.StatusCode | None = exc.code()  # type: ignore[attr-defined]
            details: str = exc.details() or ""  # type: ignore[attr-defined]
            name = code.name if code is not None else "UNKNOWN"
            raise TransferError(
                f"push of {len(header.dst_block_ids)} blocks of {header.request_id!r} to "
                f"{address} failed: {name}: {details}",
                code=code,
                details=details,
            ) from exc
        return PushResult(num_blocks=response.num_blocks, num_bytes=response.num_bytes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """Receives pushes for a `KVReceiver`; nothing reaches the receiver unless the header,
    size and checksum are all good. Every failure is an abort with a clear message."""

    def __init__(
        self,
        receiver: KVReceiver,
        tracer: trace.Tracer | None = None,
        on_push: PushObserver | None = None,
    ) -> None:
        self.receiver = receiver
        self.tracer = tracer
        self.on_push = on_push
        self._propagator = TraceContextTextMapPropagator()

    def PushBlocks(
        self,
        request_iterator: Iterable[kv_transfer_pb2.KVTransferMessage],
        context: grpc.ServicerContext,
    ) -> kv_transfer_pb2.PushBlocksResponse:
        start = time.perf_counter()
        span = self._span(context)
        try:
            response = self._push(iter(request_iterator), span)
            seconds = time.perf_counter() - start
            if span.is_recording():
                span.set_attribute("splitserve.kv.transfer_seconds", seconds)
            if self.on_push is not None:
                self.on_push(response.num_bytes, seconds, True)
            span.end()
            return response
        except PushRefused as exc:
            code, message = exc.code, str(exc)
        except KVTransferError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except Exception as exc:
            # NOTE: a bug in the receiver must fail this push, not the server. A sender that
            # hung up mid-stream also lands here; that is not worth a traceback.
            if context.is_active():
                log.exception("PushBlocks failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error receiving KV: {exc!r}"
        if self.on_push is not None:
            self.on_push(0, time.perf_counter() - start, False)
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
        span.end()
        context.abort(code, message)
        raise AssertionError("context.abort returned")  # abort always raises

    def _span(self, context: grpc.ServicerContext) -> Span:
        if self.tracer is None:
            return trace.INVALID_SPAN
        carrier = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        parent = self._propagator.extract(carrier)
        return self.tracer.start_span("kv.receive", context=parent, kind=SpanKind.SERVER)

    def _push(
        self, messages: Iterator[kv_transfer_pb2.KVTransferMessage], span: Span
    ) -> kv_transfer_pb2.PushBlocksResponse:
        first = next(messages, None)
        if first is None or first.WhichOneof("part") != "header":
            raise KVTransferError("a PushBlocks stream must start with the header")
        header = first.header
        if span.is_recording():
            span.set_attributes(
                {
                    "splitserve.request_id": header.request_id,
                    "splitserve.kv.bytes": header.payload_bytes,
                    "splitserve.kv.num_blocks": len(header.dst_block_ids),
                }
            )
        # The cheap geometry check first: a push that cannot fit is refused before the
        # reservation is looked at.
        layout = self.receiver.layout()
        validate_header(header, layout, None)
        allowed = self.receiver.check_push(header)
        validate_header(header, layout, allowed)
        payload = self._receive_payload(header, messages)
        verify_payload(header, payload)
        self.receiver.on_blocks(header, payload)
        return kv_transfer_pb2.PushBlocksResponse(
            num_blocks=len(header.dst_block_ids), num_bytes=len(payload)
        )

    @staticmethod
    def _receive_payload(
        header: kv_transfer_pb2.KVTransferHeader,
        messages: Iterator[kv_transfer_pb2.KVTransferMessage],
    ) -> bytearray:
        rid = header.request_id
        # NOTE: payload_bytes is bounded by the reservation here (validated above), so a
        # hostile header cannot make this allocation large.
        payload = bytearray(header.payload_bytes)
        received = 0
        for message in messages:
            part = message.WhichOneof("part")
            if part == "header":
                raise KVTransferError(f"{rid}: a second header in one PushBlocks stream")
            if part != "data":
                raise KVTransferError(f"{rid}: an empty message in a PushBlocks stream")
            size = len(message.data)
            if size > MAX_CHUNK_BYTES:
                raise KVTransferError(
                    f"{rid}: data message of {size} bytes exceeds {MAX_CHUNK_BYTES}"
                )
            if received + size > header.payload_bytes:
                raise KVTransferError(
                    f"{rid}: more data than declared: {received + size} bytes so far, "
                    f"header declares {header.payload_bytes}"
                )
            payload[received : received + size] = message.data
            received += size
        if received != header.payload_bytes:
            raise KVTransferError(
                f"{rid}: stream ended after {received} of {header.payload_bytes} payload bytes"
            )
        return payload
