"""KV transfer over gRPC, the portable fallback: client-streaming PushBlocks calls of one header
and data chunks of at most 4 MiB. A large push is split into up to `streams` calls on as many
connections, sent at once: one gRPC stream moves about 1 GB/s on loopback whatever the chunk
size, so parallel streams are what lift a push past that.

sender (prefill)                                       receiver (decode)
read pinned blocks ─▶ staging buffer (side stream)
GrpcKVSender.push ── header ─────────────────────▶  validate header, reservation + fence
                  ── data[0..4 MiB) ─────────────▶  into one buffer (never past payload_bytes)
                  ── data … ─────────────────────▶
                  ◀── PushBlocksResponse ────────  size + CRC-32C, then under the reservation's
                                                    hold: copy into the reserved blocks

The copy out of the pool runs on a side stream into pinned host memory, off the engine thread;
the payload is checksummed in place and sliced without copies until protobuf takes each chunk.
The receiver is a coroutine on the decode worker's asyncio server: each chunk is copied and
checksummed on a thread while the next one is read, and the final write into the pool runs on a
thread too, so a large push never stalls the event loop (the sender side is synchronous).
The push carries the sender's trace context (W3C `traceparent` metadata); a servicer given a
tracer records a `kv.receive` span under it, and reports every push to `on_push`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.engine.aio import settled
from splitserve.engine.errors import SplitserveError
from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer.grpc_codec import (
    PUSH_BLOCKS,
    Part,
    as_part,
    encode_part,
)
from splitserve.kv_transfer.host_buffers import HostBuffers
from splitserve.kv_transfer.transport import (
    KVSender,
    Landing,
    Peer,
    Push,
    PushObserver,
    PushResult,
    TransferError,
)
from splitserve.kv_transfer.wire import (
    MAX_CHUNK_BYTES,
    CacheLayout,
    ChecksumError,
    KVTransferError,
    as_blocks,
    crc32c,
    make_header,
    validate_header,
)
from splitserve.protos.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

# A data message is <= 4 MiB plus framing; the headroom lets a large header through.
MAX_MESSAGE_BYTES = 2 * MAX_CHUNK_BYTES
DEFAULT_STREAMS = 4
MIN_STREAM_BYTES = 8 << 20  # a push is split into streams of at least this much
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
"""Options for channels and servers that carry KVTransfer."""


class GrpcKVSender(KVSender):
    """Pushes blocks over cached channels to each receiver address (one connection per
    parallel stream)."""

    name = "grpc"

    def __init__(
        self,
        connector: KVConnector,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        streams: int = DEFAULT_STREAMS,
        min_stream_bytes: int = MIN_STREAM_BYTES,
    ) -> None:
        if not 0 < max_chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]")
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self.connector = connector
        self.layout = CacheLayout.of(connector.region())
        self.max_chunk_bytes = max_chunk_bytes
        self.streams = streams
        self.min_stream_bytes = min_stream_bytes
        self._buffers = HostBuffers(pinned=connector.region().device.type == "cuda")
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, int], tuple[grpc.Channel, Any]] = {}
        self._pool = ThreadPoolExecutor(4 * streams, thread_name_prefix="kv-grpc")
        self._closed = False
        self._propagator = TraceContextTextMapPropagator()

    def _stub(self, address: str, lane: int = 0) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("GrpcKVSender is closed")
            entry = self._channels.get((address, lane))
            if entry is None:
                # NOTE: a channel with a subchannel pool of its own is a connection of its own,
                # so the lanes' streams don't share one TCP connection.
                options = (*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))
                channel = grpc.insecure_channel(address, options=options)
                call = channel.stream_unary(
                    PUSH_BLOCKS,
                    request_serializer=encode_part,
                    response_deserializer=kv_transfer_pb2.PushBlocksResponse.FromString,
                )
                entry = (channel, call)
                self._channels[(address, lane)] = entry
            return entry[1]

    def _messages(
        self, header: kv_transfer_pb2.KVTransferHeader, payload: memoryview
    ) -> Iterator[Part]:
        yield header
        step = self.max_chunk_bytes
        for start in range(0, len(payload), step):
            yield payload[start : start + step]  # encoded (copied once) by `encode_part`

    def push(self, peer: Peer, push: Push, timeout_s: float) -> PushResult:
        num_blocks = len(push.src_block_ids)
        block_bytes = self.layout.block_bytes
        buf = self._buffers.take(num_blocks * block_bytes)
        try:
            self.connector.read_blocks(push.src_block_ids, as_blocks(buf, self.layout), push.ready)
            payload = memoryview(buf.numpy())  # type: ignore[arg-type]
            lanes = max(1, min(self.streams, num_blocks * block_bytes // self.min_stream_bytes))
            bounds = [num_blocks * i // lanes for i in range(lanes + 1)]
            carrier: dict[str, str] = {}
            self._propagator.inject(carrier)  # nothing unless a recording span is current
            parts = []
            for start, end in zip(bounds, bounds[1:], strict=False):
                part = payload[start * block_bytes : end * block_bytes]
                header = make_header(
                    push.request_id, push.fence, self.layout, push.dst_block_ids[start:end],
                    len(part), crc32c(part), push.num_tokens,
                )  # fmt: skip
                parts.append((header, part))
            if len(parts) == 1:
                return self._send(peer.address, *parts[0], timeout_s, carrier)
            futures = [
                self._pool.submit(self._send, peer.address, header, part, timeout_s, carrier, i)
                for i, (header, part) in enumerate(parts)
            ]
            results = [f.result() for f in futures]  # NOTE: all settle before `buf` is reused
            return PushResult(sum(r.num_blocks for r in results), sum(r.num_bytes for r in results))
        finally:
            self._buffers.give(buf)

    def _send(
        self,
        address: str,
        header: kv_transfer_pb2.KVTransferHeader,
        payload: memoryview,
        timeout_s: float,
        carrier: dict[str, str] | None = None,
        lane: int = 0,
    ) -> PushResult:
        if carrier is None:
            carrier = {}
            self._propagator.inject(carrier)
        try:
            response = self._stub(address, lane)(
                self._messages(header, payload),
                timeout=timeout_s,
                metadata=tuple(carrier.items()) or None,
            )
        except grpc.RpcError as exc:
            code: grpc.StatusCode | None = exc.code()  # type: ignore[attr-defined]
            details: str = exc.details() or ""  # type: ignore[attr-defined]
            name = code.name if code is not None else "UNAVAILABLE"
            raise TransferError(
                f"push of {len(header.dst_block_ids)} blocks of {header.request_id!r} to "
                f"{address} failed: {name}: {details}",
                name if name != "UNKNOWN" else "UNAVAILABLE",
            ) from exc
        return PushResult(num_blocks=response.num_blocks, num_bytes=response.num_bytes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel, _ in channels.values():
            channel.close()


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
        self.tracer = tracer
        self.on_push = on_push
        self._buffers = HostBuffers(pinned=region.device.type == "cuda")
        self._propagator = TraceContextTextMapPropagator()

    async def PushBlocks(
        self,
        request_iterator: AsyncIterable[Part | kv_transfer_pb2.KVTransferMessage],
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.PushBlocksResponse:
        start = time.perf_counter()
        span = self._span(context)
        try:
            response = await self._push(aiter(request_iterator), span)
            seconds = time.perf_counter() - start
            if span.is_recording():
                span.set_attribute("splitserve.kv.transfer_seconds", seconds)
            if self.on_push is not None:
                self.on_push(response.num_bytes, seconds, True)
            span.end()
            return response
        except asyncio.CancelledError:
            # NOTE: the sender hung up (or the server stops): nothing to answer, nothing to log.
            self._failed(span, start, "CANCELLED: the sender went away")
            raise
        except SplitserveError as exc:
            code, message = grpc.StatusCode[exc.status], str(exc)
        except Exception as exc:
            # NOTE: a bug in the receiver must fail this push, not the server.
            log.exception("PushBlocks failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error receiving KV: {exc!r}"
        self._failed(span, start, f"{code.name}: {message}")
        await context.abort(code, message)
        raise AssertionError("context.abort returned")  # abort always raises

    def _failed(self, span: Span, start: float, description: str) -> None:
        if self.on_push is not None:
            self.on_push(0, time.perf_counter() - start, False)
        span.set_status(Status(StatusCode.ERROR, description))
        span.end()

    def _span(self, context: grpc.aio.ServicerContext) -> Span:
        if self.tracer is None:
            return trace.INVALID_SPAN
        carrier = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        parent = self._propagator.extract(carrier)
        return self.tracer.start_span("kv.receive", context=parent, kind=SpanKind.SERVER)

    async def _push(
        self,
        messages: AsyncIterator[Part | kv_transfer_pb2.KVTransferMessage],
        span: Span,
    ) -> kv_transfer_pb2.PushBlocksResponse:
        header = as_part(await anext(messages, None))
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
        validate_header(header, self.layout, self.num_blocks, None)
        allowed = self.landing.allowed_blocks(header.request_id, header.fence)
        validate_header(header, self.layout, self.num_blocks, allowed)
        # NOTE: allocating (pinning) a large buffer takes a while: off the loop.
        buf = await asyncio.to_thread(self._buffers.take, header.payload_bytes)
        try:
            payload = buf.numpy()
            checksum = await self._receive(header, messages, payload)
            if checksum != header.crc32c:
                raise ChecksumError(
                    f"{header.request_id}: checksum mismatch: payload CRC-32C "
                    f"{checksum:#010x}, header {header.crc32c:#010x}"
                )
            await _in_thread(self._land, header, buf)
        finally:
            self._buffers.give(buf)
        return kv_transfer_pb2.PushBlocksResponse(
            num_blocks=len(header.dst_block_ids), num_bytes=header.payload_bytes
        )

    def _land(self, header: kv_transfer_pb2.KVTransferHeader, buf: torch.Tensor) -> None:
        """Write the payload into the reserved blocks, under the reservation's hold (which
        waits for, and keeps out, a reclaim of its blocks)."""
        dst = list(header.dst_block_ids)
        with self.landing.hold(header.request_id, header.fence, dst, header.payload_bytes):
            self.connector.write_blocks(dst, as_blocks(buf, self.layout))

    @staticmethod
    async def _receive(
        header: kv_transfer_pb2.KVTransferHeader,
        messages: AsyncIterator[Part | kv_transfer_pb2.KVTransferMessage],
        payload: Any,
    ) -> int:
        """Fill `payload` from the data messages; returns its CRC-32C, computed as the chunks
        arrive (the checksum pass overlaps the transfer instead of following it).

        Each chunk is copied and checksummed on a thread while the loop reads the next one; at
        most one copy is in flight, and all are settled before this returns or raises (the
        buffer is reused after)."""
        rid = header.request_id
        out = memoryview(payload).cast("B")
        received = checksum = 0
        copying: asyncio.Future[int] | None = None
        try:
            async for message in messages:
                data = as_part(message)
                if isinstance(data, kv_transfer_pb2.KVTransferHeader):
                    raise KVTransferError(f"{rid}: a second header in one PushBlocks stream")
                if data is None:
                    raise KVTransferError(f"{rid}: an empty message in a PushBlocks stream")
                size = len(data)
                if size > MAX_CHUNK_BYTES:
                    raise KVTransferError(
                        f"{rid}: data message of {size} bytes exceeds {MAX_CHUNK_BYTES}"
                    )
                if received + size > header.payload_bytes:
                    raise KVTransferError(
                        f"{rid}: more data than declared: {received + size} bytes so far, "
                        f"header declares {header.payload_bytes}"
                    )
                if copying is not None:
                    checksum = await _in_thread_done(copying)
                    copying = None
                if size < INLINE_COPY_BYTES:  # a thread hop would cost more than the copy
                    checksum = _copy_chunk(out, received, data, checksum)
                else:
                    copying = asyncio.get_running_loop().run_in_executor(
                        None, _copy_chunk, out, received, data, checksum
                    )
                received += size
            if copying is not None:
                checksum = await _in_thread_done(copying)
                copying = None
        finally:
            if copying is not None:
                await settled(copying)
        if received != header.payload_bytes:
            raise KVTransferError(
                f"{rid}: stream ended after {received} of {header.payload_bytes} payload bytes"
            )
        return checksum


INLINE_COPY_BYTES = 64 << 10
"""Data chunks smaller than this are copied on the event loop; larger ones on a thread."""


def _copy_chunk(out: memoryview, offset: int, data: memoryview, checksum: int) -> int:
    out[offset : offset + len(data)] = data
    return crc32c(data, checksum)


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the loop's default executor; a cancel waits for it to end first (it
    works on buffers that are reused once this returns)."""
    return await _in_thread_done(asyncio.get_running_loop().run_in_executor(None, fn, *args))


async def _in_thread_done(future: asyncio.Future[T]) -> T:
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await settled(future)
        raise
