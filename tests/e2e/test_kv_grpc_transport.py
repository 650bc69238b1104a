"""KV blocks over the gRPC transport, end to end on loopback with real components.

A real `GrpcKVReceiver` (a synchronous gRPC server of its own on a loopback port, in this process)
serves a `KVTransferServicer` over a receiver pool, landing pushes through the decode worker's real
`ReservationBook`; a `GrpcKVSender` pushes from a separate sender pool; both pools sit behind real
`KVConnector`s (no model; `kv_grpc_pools.py`). Proven here: multi-chunk pushes land bit-exact in
shuffled blocks and nowhere else, half precision keeps its raw bits, concurrent pushes all land,
reservations complete as their blocks arrive, a reservation reclaimed mid-push is written nothing,
an unreachable receiver fails fast with UNAVAILABLE. Refusals: `test_kv_grpc_refusals.py`.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from splitserve.decode_service.reservations import ReservationBook
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer import transport as kv_transport
from splitserve.kv_transfer.grpc_receiver import GrpcKVReceiver
from splitserve.kv_transfer.grpc_transport import GrpcKVSender
from splitserve.kv_transfer.transport import Peer, Push, PushResult, TransferError
from splitserve.kv_transfer.wire import MAX_CHUNK_BYTES, CacheLayout
from splitserve.protos.v1 import kv_transfer_pb2
from tests.e2e.kv_grpc_pools import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_BLOCKS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    TIMEOUT_S,
    Receiver,
    assert_landed,
    make_connector,
    make_pool,
    push_of,
    raw,
    refused,
)

pytestmark = pytest.mark.slow


# -- landing -------------------------------------------------------------------------------------


class ChunkCountingSender(GrpcKVSender):
    """Records the size of every data message it streams."""

    def __init__(self, connector: KVConnector) -> None:
        super().__init__(connector)
        self.chunks: list[int] = []

    def _messages(  # type: ignore[override]
        self, header: kv_transfer_pb2.KVTransferHeader, payload: memoryview
    ) -> Iterator[kv_transfer_pb2.KVTransferHeader | memoryview]:
        for message in super()._messages(header, payload):
            if isinstance(message, memoryview):
                self.chunks.append(len(message))
            yield message


def test_push_over_4_mib_lands_bit_exact_in_shuffled_blocks_and_nothing_else_changes(
    receiver: Receiver, senders: Callable[..., GrpcKVSender], src_pool: torch.Tensor
) -> None:
    rng = random.Random(7)
    src = rng.sample(range(NUM_BLOCKS), 72)  # non-contiguous, shuffled on both sides
    dst = rng.sample(range(NUM_BLOCKS), 72)
    res = receiver.reserve("big", fence=5, block_ids=dst)
    sender = senders(src_pool, ChunkCountingSender)
    src_before = raw(src_pool).clone()
    num_bytes = 72 * BLOCK_BYTES
    assert num_bytes == 9 << 20 == CacheLayout.of(sender.connector.region()).payload_bytes(72)

    result = sender.push(receiver.peer, push_of("big", 5, src, dst), timeout_s=TIMEOUT_S)

    assert result == PushResult(num_blocks=72, num_bytes=num_bytes)
    assert sender.chunks == [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, 1 << 20]  # several chunks
    assert_landed(receiver, src_pool, src, dst)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))
    assert not raw(receiver.pool[untouched]).any()
    assert torch.equal(raw(src_pool), src_before)  # the sender only reads its pool
    assert res.received == set(dst) and res.num_bytes == num_bytes
    assert res.complete and res.wait_complete(0)
    assert [(n, ok) for n, _, ok in receiver.pushes] == [(num_bytes, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_blocks_cross_bit_exact(
    receivers: Callable[..., Receiver], senders: Callable[..., GrpcKVSender], dtype: torch.dtype
) -> None:
    receiver = receivers(dtype)
    src_pool = make_pool(dtype, seed=2)  # every 16-bit pattern may occur, NaNs included
    sender = senders(src_pool)
    src, dst = [1, 50, 9, 90, 33], [40, 7, 22, 95, 0]
    receiver.reserve("half", fence=3, block_ids=dst)

    sender.push(receiver.peer, push_of("half", 3, src, dst), timeout_s=TIMEOUT_S)

    got = receiver.pool[dst].view(torch.int16)
    want = src_pool[src].view(torch.int16)
    assert torch.equal(got, want)
    assert torch.isnan(receiver.pool[dst].float()).any()  # NaN bits crossed unharmed, too


def test_an_empty_push_is_acknowledged_and_changes_nothing(
    receiver: Receiver, sender: GrpcKVSender
) -> None:
    res = receiver.reserve("none", fence=1, block_ids=[3])
    before = receiver.snapshot()
    result = sender.push(receiver.peer, push_of("none", 1, [], []), timeout_s=TIMEOUT_S)
    assert result == PushResult(0, 0)
    receiver.assert_unchanged(before)
    assert not res.complete


# -- concurrency and reservations ----------------------------------------------------------------


def test_concurrent_pushes_from_four_threads_all_land(
    receiver: Receiver, sender: GrpcKVSender, src_pool: torch.Tensor
) -> None:
    jobs = []
    for t in range(4):
        dst = list(range(t, NUM_BLOCKS, 4))[:12]  # interleaved across requests
        src = list(range(12 * t, 12 * t + 12))[::-1]
        receiver.reserve(f"r{t}", fence=t + 1, block_ids=dst)
        jobs.append(push_of(f"r{t}", t + 1, src, dst))

    with futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: sender.push(receiver.peer, p, TIMEOUT_S), jobs))

    assert [r.num_blocks for r in results] == [12] * 4
    for push in jobs:
        assert_landed(receiver, src_pool, push.src_block_ids, push.dst_block_ids)
        res = receiver.book.get(push.request_id)
        assert res is not None and res.complete
    landed = {b for p in jobs for b in p.dst_block_ids}
    assert not raw(receiver.pool[sorted(set(range(NUM_BLOCKS)) - landed)]).any()


def test_a_reservation_completes_once_its_needed_blocks_land(
    receiver: Receiver, sender: GrpcKVSender, src_pool: torch.Tensor
) -> None:
    # Six blocks, the first two a cached prefix on the receiver: four to push, in two batches.
    res = receiver.reserve(
        "req", fence=4, block_ids=[30, 31, 70, 5, 12, 60], num_cached_tokens=2 * BLOCK_SIZE
    )
    assert res.needed == {70, 5, 12, 60}
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(res.wait_complete(TIMEOUT_S)))
    waiter.start()

    sender.push(receiver.peer, push_of("req", 4, [0, 1], [70, 5]), timeout_s=TIMEOUT_S)
    assert not res.complete
    assert res.progress() == "2 of 4 blocks"
    assert not res.wait_complete(0.01)
    assert waiter.is_alive()

    sender.push(receiver.peer, push_of("req", 4, [2, 3], [12, 60]), timeout_s=TIMEOUT_S)
    waiter.join(TIMEOUT_S)
    assert waited == [True]
    assert res.complete and res.wait_complete(0)
    assert res.progress() == "4 of 4 blocks"
    assert res.num_bytes == 4 * BLOCK_BYTES
    assert_landed(receiver, src_pool, [0, 1, 2, 3], [70, 5, 12, 60])
    assert not raw(receiver.pool[[30, 31]]).any()  # the cached prefix is left alone


class GatedSender(GrpcKVSender):
    """Streams the header, then holds the data back until `gate` opens."""

    def __init__(self, connector: KVConnector) -> None:
        super().__init__(connector)
        self.gate = threading.Event()

    def _messages(  # type: ignore[override]
        self, header: kv_transfer_pb2.KVTransferHeader, payload: memoryview
    ) -> Iterator[kv_transfer_pb2.KVTransferMessage]:
        messages = super()._messages(header, payload)
        yield next(messages)
        if not self.gate.wait(TIMEOUT_S):
            raise TimeoutError("gate never opened")
        yield from messages


def push_held_at_the_gate(
    receiver: Receiver, sender: GatedSender, push: Push, monkeypatch: pytest.MonkeyPatch
) -> futures.Future[PushResult]:
    """Start `push` and return once the receiver has checked its header against the
    reservation (the data is still held back)."""
    checked = threading.Event()
    allowed_blocks = receiver.book.allowed_blocks

    def spy(request_id: str, fence: int) -> frozenset[int]:
        try:
            return allowed_blocks(request_id, fence)
        finally:
            checked.set()

    monkeypatch.setattr(receiver.book, "allowed_blocks", spy)
    pool = futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(sender.push, receiver.peer, push, TIMEOUT_S)
    pool.shutdown(wait=False)
    assert checked.wait(TIMEOUT_S), "the receiver never checked the header"
    return future


def test_a_push_in_flight_when_its_reservation_is_reclaimed_writes_nothing(
    receiver: Receiver,
    senders: Callable[..., GrpcKVSender],
    src_pool: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sender = senders(src_pool, GatedSender)
    res = receiver.reserve("req", fence=3, block_ids=[20, 21, 22])
    future = push_held_at_the_gate(
        receiver, sender, push_of("req", 3, [0, 1, 2], [20, 21, 22]), monkeypatch
    )
    before = receiver.snapshot()

    assert receiver.book.pop("req") is res  # reclaimed: its blocks may go to another request
    sender.gate.set()

    with pytest.raises(TransferError) as info:
        future.result(TIMEOUT_S)
    assert info.value.status in ("NOT_FOUND", "FAILED_PRECONDITION")
    receiver.assert_unchanged(before)
    assert res.dead and not res.received
    assert not res.wait_complete(0)


def test_a_push_in_flight_when_its_reservation_is_reclaimed_is_failed_precondition(
    receiver: Receiver,
    senders: Callable[..., GrpcKVSender],
    src_pool: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sender = senders(src_pool, GatedSender)
    receiver.reserve("req", fence=3, block_ids=[20, 21, 22])
    future = push_held_at_the_gate(
        receiver, sender, push_of("req", 3, [0, 1, 2], [20, 21, 22]), monkeypatch
    )
    receiver.book.pop("req")
    sender.gate.set()
    with pytest.raises(TransferError) as info:
        future.result(TIMEOUT_S)
    assert info.value.status == "FAILED_PRECONDITION", str(info.value)


def test_a_push_in_flight_when_its_reservation_is_re_made_is_failed_precondition(
    receiver: Receiver,
    senders: Callable[..., GrpcKVSender],
    src_pool: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sender = senders(src_pool, GatedSender)
    receiver.reserve("req", fence=3, block_ids=[20, 21, 22])
    future = push_held_at_the_gate(
        receiver, sender, push_of("req", 3, [0, 1, 2], [20, 21, 22]), monkeypatch
    )
    before = receiver.snapshot()
    newer = receiver.reserve("req", fence=4, block_ids=[20, 21, 22])
    sender.gate.set()

    with pytest.raises(TransferError) as info:
        future.result(TIMEOUT_S)
    assert info.value.status == "FAILED_PRECONDITION"
    assert "stale fencing token 3" in str(info.value)
    receiver.assert_unchanged(before)
    assert not newer.received


class SlowWriteConnector(KVConnector):
    """A real connector whose `write_blocks` waits for `release` once it has started."""

    def __init__(self, cache: KVCache, block_manager: BlockManager, block_size: int) -> None:
        super().__init__(cache, block_manager, block_size)
        self.writing = threading.Event()
        self.release = threading.Event()

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        self.writing.set()
        assert self.release.wait(TIMEOUT_S)
        super().write_blocks(block_ids, data)


def test_reclaiming_waits_for_a_write_in_progress(
    receiver: Receiver, sender: GrpcKVSender, src_pool: torch.Tensor
) -> None:
    """The write lands under the reservation's hold: `pop` returns only after it is done, so
    blocks are never freed under a write."""
    pool = receiver.pool
    connector = SlowWriteConnector(
        KVCache.over(pool), BlockManager(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE
    )
    receiver.servicer.connector = connector
    res = receiver.reserve("req", fence=1, block_ids=[9, 3])
    with futures.ThreadPoolExecutor(max_workers=2) as workers:
        pushed = workers.submit(
            sender.push, receiver.peer, push_of("req", 1, [0, 1], [9, 3]), TIMEOUT_S
        )
        assert connector.writing.wait(TIMEOUT_S)
        popped = workers.submit(receiver.book.pop, "req")
        time.sleep(0.2)
        assert not popped.done(), "pop returned while a write into its blocks was in progress"
        connector.release.set()
        assert pushed.result(TIMEOUT_S) == PushResult(2, 2 * BLOCK_BYTES)
        assert popped.result(TIMEOUT_S) is res
    assert res.dead and res.received == {9, 3}
    assert_landed(receiver, src_pool, [0, 1], [9, 3])


# -- the sender's side ---------------------------------------------------------------------------


def test_the_grpc_transport_kind_builds_a_grpc_sender_and_a_receiver_of_its_own(
    src_pool: torch.Tensor,
) -> None:
    kind = kv_transport.transport_kind("grpc")
    sender = kind.sender(make_connector(src_pool), "w")
    try:
        assert isinstance(sender, GrpcKVSender) and sender.name == "grpc"
        assert sender.layout == CacheLayout(
            NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32
        )
    finally:
        sender.close()
    receiver = kind.receiver(make_connector(make_pool()), ReservationBook(), "w")
    try:  # its own server, on the port it publishes
        assert isinstance(receiver, GrpcKVReceiver)
        assert receiver.endpoint() == {"grpc.address": f"127.0.0.1:{receiver.port}".encode()}
    finally:
        receiver.close()
    with pytest.raises(ValueError, match="unknown KV transport 'carrier-pigeon'"):
        kv_transport.transport_kind("carrier-pigeon")


def test_an_unreachable_receiver_raises_unavailable_quickly(sender: GrpcKVSender) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nobody listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    peer = Peer("gone", f"127.0.0.1:{port}", {})
    start = time.monotonic()
    with pytest.raises(TransferError) as info:
        sender.push(peer, push_of("req", 1, [0], [0]), timeout_s=2.0)
    assert time.monotonic() - start < 2.5
    assert info.value.status == "UNAVAILABLE"
    assert f"to 127.0.0.1:{port} failed: UNAVAILABLE" in str(info.value)


def test_a_closed_sender_refuses_to_push(receiver: Receiver, sender: GrpcKVSender) -> None:
    receiver.reserve("req", fence=1, block_ids=[0])
    sender.push(receiver.peer, push_of("req", 1, [0], [0]), timeout_s=TIMEOUT_S)
    sender.close()
    with pytest.raises(RuntimeError, match="GrpcKVSender is closed"):
        sender.push(receiver.peer, push_of("req", 1, [0], [0]), timeout_s=TIMEOUT_S)


def test_a_push_carries_its_trace_into_a_kv_receive_span(
    receivers: Callable[..., Receiver], sender: GrpcKVSender
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    receiver = receivers(tracer=tracer)
    receiver.reserve("req", fence=1, block_ids=[2, 3])

    with tracer.start_as_current_span("kv.send") as parent:
        sender.push(receiver.peer, push_of("req", 1, [0, 1], [2, 3]), timeout_s=TIMEOUT_S)
        refused(sender, receiver.peer, push_of("req", 9, [0, 1], [2, 3]))  # stale fence

    spans = [s for s in exporter.get_finished_spans() if s.name == "kv.receive"]
    assert len(spans) == 2
    good, bad = spans
    trace_id = parent.get_span_context().trace_id
    for span in spans:
        assert span.context.trace_id == trace_id
        assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
    assert good.attributes["splitserve.request_id"] == "req"
    assert good.attributes["splitserve.kv.num_blocks"] == 2
    assert good.attributes["splitserve.kv.bytes"] == 2 * BLOCK_BYTES
    assert bad.status.status_code is StatusCode.ERROR
    assert "FAILED_PRECONDITION" in (bad.status.description or "")
