"""The receiving half of the gRPC KV transport: a synchronous gRPC server of its own, on its own
port, serving PushBlocks into a pool.

It is not served by the worker's asyncio server on purpose: a push is a stream of 4 MiB chunks
that each need a copy and a checksum pass, and on one event loop every stream of every push
shares one thread for all of that (measured on an H200 pair: 1.87 GB/s for a 4k-token 8B
push, where a thread per stream moves 2.46; docs/benchmarks.md). Here each stream has a
thread of the server's pool, which copies and checksums its chunks as they arrive (the copy
and the C CRC-32C release the GIL), so parallel streams run in parallel.

    sender ── PushBlocks (4 streams) ──▶ "kv-grpc-recv" threads: validate header, reservation
                                          and fence; fill one host buffer, CRC as it fills;
                                          under the reservation's hold, write into the blocks

The receiver publishes its address in the registry (`endpoint()`: `grpc.address`); senders
fall back to the worker's own address only for a peer that names no KV transport (one that
names its transports has a receiver of its own: a missing record is a lapse, and the push is
refused as retryable rather than sent to a front that serves none).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.engine.errors import SplitserveError
from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer.cluster import MemberOnlyInterceptor
from splitserve.kv_transfer.grpc_codec import ENDPOINT_KEY, Part, add_kv_transfer_servicer, as_part
from splitserve.kv_transfer.host_buffers import HostBuffers
from splitserve.kv_transfer.transport import KVReceiver, Landing, PushObserver, ReceiverBind
from splitserve.kv_transfer.wire import (
    MAX_CHUNK_BYTES,
    CacheLayout,
    ChecksumError,
    KVTransferError,
    as_blocks,
    crc32c,
    split_payload,
    validate_header,
)
from splitserve.protos.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)

RECEIVER_THREADS = 16
"""Concurrent PushBlocks streams served (a push uses up to 4); more wait for a thread."""
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", 2 * MAX_CHUNK_BYTES),
    ("grpc.max_receive_message_length", 2 * MAX_CHUNK_BYTES),
    ("grpc.so_reuseport", 0),  # a taken port is an error, never a shared one
)


class GrpcKVReceiver(KVReceiver):
    """A `KVTransferServicer` on a synchronous server of its own (see the module doc)."""

    name = "grpc"

    def __init__(
        self,
        connector: KVConnector,
        landing: Landing,
        worker_id: str,
        tracer: trace.Tracer | None = None,
        on_push: PushObserver | None = None,
        bind: ReceiverBind | None = None,
    ) -> None:
        bind = bind or ReceiverBind()
        self.servicer = KVTransferServicer(connector, landing, tracer, on_push)
        # NOTE: with a cluster secret, a push without it is refused before a byte is read.
        members_only = [MemberOnlyInterceptor(bind.cluster_secret)] if bind.cluster_secret else []
        self._server = grpc.server(
            ThreadPoolExecutor(RECEIVER_THREADS, thread_name_prefix="kv-grpc-recv"),
            options=SERVER_OPTIONS,
            interceptors=members_only,
        )
        add_kv_transfer_servicer(self.servicer, self._server)
        try:
            self.port = self._server.add_insecure_port(f"{bind.host}:{bind.port}")
        except RuntimeError as exc:
            raise RuntimeError(
                f"{worker_id}: the gRPC KV receiver cannot listen on {bind.host}:{bind.port} "
                f"({exc})"
            ) from exc
        self.address = f"{bind.public_host or bind.host}:{self.port}"
        self._server.start()

    def endpoint(self) -> dict[str, bytes]:
        return {ENDPOINT_KEY: self.address.encode()}

    def close(self) -> None:
        self._server.stop(grace=1.0).wait()


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """Receives pushes into a pool; nothing reaches the pool unless the header, size and
    checksum are all good and the reservation holds. Every failure is an abort with a clear
    message."""

    def __init__(
        self,
        connector: KVConnector,
        landing: Landing,
        tracer: trace.Tracer | None = None,
        on_push: PushObserver | None = None,
    ) -> None:
        self.connector = connector
        self.landing = landing
        region = connector.region()
        self.layout = CacheLayout.of(region)
        self.num_blocks = region.num_blocks
        self.num_slots = region.window.num_slots if region.window is not None else 0
        self.tracer = tracer
        self.on_push = on_push
        self._buffers = HostBuffers(pinned=region.device.type == "cuda")
        self._propagator = TraceContextTextMapPropagator()

    def PushBlocks(
        self,
        request_iterator: Iterable[Part | kv_transfer_pb2.KVTransferMessage],
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
        except SplitserveError as exc:
            code, message = grpc.StatusCode[exc.status], str(exc)
        except Exception as exc:
            # NOTE: a bug in the receiver must fail this push, not the server. A sender that
            # hung up mid-stream lands here too; that is not worth a traceback.
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
        self, messages: Iterator[Part | kv_transfer_pb2.KVTransferMessage], span: Span
    ) -> kv_transfer_pb2.PushBlocksResponse:
        header = as_part(next(messages, None))
        if not isinstance(header, kv_transfer_pb2.KVTransferHeader):
            raise KVTransferError("a PushBlocks stream must start with the header")
        if span.is_recording():
            span.set_attributes(
                {
                    "splitserve.request_id": header.request_id,
                    "splitserve.kv.bytes": header.payload_bytes,
                    "splitserve.kv.num_blocks": len(header.dst_block_ids),
                    "splitserve.kv.transport": "grpc",
                }
            )
        # The cheap geometry check first: a push that cannot fit is refused before the
        # reservation is looked at, and no allocation is larger than the reservation allows.
        validate_header(header, self.layout, self.num_blocks, None, self.num_slots)
        allowed = self.landing.allowed_blocks(header.request_id, header.fence)
        self.landing.check_capability(header.request_id, header.capability)
        validate_header(header, self.layout, self.num_blocks, allowed, self.num_slots)
        if self.num_slots:
            self.landing.check_window(
                header.request_id, header.fence, header.dst_block_ids, header.dst_window_slots
            )
        buf = self._buffers.take(header.payload_bytes)
        try:
            checksum = _receive(header, messages, buf.numpy())
            if checksum != header.crc32c:
                raise ChecksumError(
                    f"{header.request_id}: checksum mismatch: payload CRC-32C "
                    f"{checksum:#010x}, header {header.crc32c:#010x}"
                )
            self._land(header, buf)
        finally:
            self._buffers.give(buf)
        return kv_transfer_pb2.PushBlocksResponse(
            num_blocks=len(header.dst_block_ids), num_bytes=header.payload_bytes
        )

    def _land(self, header: kv_transfer_pb2.KVTransferHeader, buf: torch.Tensor) -> None:
        """Write the payload into the reserved blocks, under the reservation's hold (which
        waits for, and keeps out, a reclaim of its blocks)."""
        dst, slots = list(header.dst_block_ids), list(header.dst_window_slots)
        with self.landing.hold(header.request_id, header.fence, dst, header.payload_bytes):
            if not slots:
                self.connector.write_blocks(dst, as_blocks(buf, self.layout))
                return
            blocks, window = split_payload(buf, self.layout, len(dst))
            self.connector.write_blocks(dst, blocks)
            self.connector.write_slots(slots, window)


def _receive(
    header: kv_transfer_pb2.KVTransferHeader,
    messages: Iterator[Part | kv_transfer_pb2.KVTransferMessage],
    payload: np.ndarray,
) -> int:
    """Fill `payload` (bytes) from the data messages; returns its CRC-32C, computed as the chunks
    arrive (the checksum pass overlaps the transfer instead of following it)."""
    rid = header.request_id
    out = payload.reshape(-1).view(np.uint8)
    received = checksum = 0
    for message in messages:
        data = as_part(message)
        if isinstance(data, kv_transfer_pb2.KVTransferHeader):
            raise KVTransferError(f"{rid}: a second header in one PushBlocks stream")
        if data is None:
            raise KVTransferError(f"{rid}: an empty message in a PushBlocks stream")
        size = len(data)
        if size > MAX_CHUNK_BYTES:
            raise KVTransferError(f"{rid}: data message of {size} bytes exceeds {MAX_CHUNK_BYTES}")
        if received + size > header.payload_bytes:
            raise KVTransferError(
                f"{rid}: more data than declared: {received + size} bytes so far, "
                f"header declares {header.payload_bytes}"
            )
        out[received : received + size] = np.frombuffer(data, np.uint8)  # copies without the GIL
        checksum = crc32c(data, checksum)
        received += size
    if received != header.payload_bytes:
        raise KVTransferError(
            f"{rid}: stream ended after {received} of {header.payload_bytes} payload bytes"
        )
    return checksum
