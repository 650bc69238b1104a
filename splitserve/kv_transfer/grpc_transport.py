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
The receiver (`grpc_receiver`) is a synchronous server of its own, a thread per stream; a push
goes to the address it published (`grpc.address`), else to the worker's own address.
The push carries the sender's trace context (W3C `traceparent` metadata); a receiver given a
tracer records a `kv.receive` span under it, and reports every push to `on_push`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer.cluster import secret_metadata
from splitserve.kv_transfer.grpc_codec import (
    ENDPOINT_KEY,
    PUSH_BLOCKS,
    Part,
    encode_part,
)
from splitserve.kv_transfer.host_buffers import HostBuffers
from splitserve.kv_transfer.transport import (
    KVSender,
    Peer,
    Push,
    PushResult,
    TransferError,
)
from splitserve.kv_transfer.wire import (
    MAX_CHUNK_BYTES,
    CacheLayout,
    as_blocks,
    crc32c,
    make_header,
    split_payload,
)
from splitserve.protos.v1 import kv_transfer_pb2

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
        cluster_secret: str = "",
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
        self._member = secret_metadata(cluster_secret)  # NOTE: on every push, if configured

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
        num_blocks, num_slots = len(push.src_block_ids), len(push.dst_window_slots)
        block_bytes = self.layout.block_bytes
        buf = self._buffers.take(self.layout.payload_bytes(num_blocks, num_slots))
        try:
            if num_slots:  # NOTE: the sliding layers' slots follow the blocks (wire.py)
                blocks, slots = split_payload(buf, self.layout, num_blocks)
                self.connector.read_blocks(push.src_block_ids, blocks, push.ready)
                self.connector.read_slots(push.src_window_slots, slots, push.ready)
            else:
                self.connector.read_blocks(
                    push.src_block_ids, as_blocks(buf, self.layout), push.ready
                )
            payload = memoryview(buf.numpy())  # type: ignore[arg-type]
            lanes = max(1, min(self.streams, num_blocks * block_bytes // self.min_stream_bytes))
            bounds = [num_blocks * i // lanes for i in range(lanes + 1)]
            carrier: dict[str, str] = {}
            self._propagator.inject(carrier)  # nothing unless a recording span is current
            parts = []
            for start, end in zip(bounds, bounds[1:], strict=False):
                last = end == num_blocks  # NOTE: the window slots travel with the last lane
                stop = len(payload) if last else end * block_bytes
                part = payload[start * block_bytes : stop]
                header = make_header(
                    push.request_id, push.fence, self.layout, push.dst_block_ids[start:end],
                    len(part), crc32c(part), push.num_tokens, push.capability,
                    push.dst_window_slots if last else (),
                )  # fmt: skip
                parts.append((header, part))
            address = receiver_address(peer)
            if len(parts) == 1:
                return self._send(address, *parts[0], timeout_s, carrier)
            futures = [
                self._pool.submit(self._send, address, header, part, timeout_s, carrier, i)
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
                metadata=(*carrier.items(), *self._member) or None,
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


def receiver_address(peer: Peer) -> str:
    """Where `peer` receives gRPC pushes: the address its receiver published, else its own."""
    published = peer.endpoint.get(ENDPOINT_KEY)
    return published.decode() if published else peer.address
