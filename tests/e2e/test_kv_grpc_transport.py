"""KV blocks over the gRPC transport, end to end on loopback with real components.

A real `GrpcKVReceiver` (a synchronous gRPC server of its own on a loopback port, in this process)
serves a `KVTransferServicer` over a receiver pool, landing pushes through the decode worker's real
`ReservationBook`; a `GrpcKVSender` pushes from a separate sender pool. Both pools sit behind real
`KVConnector`s (no model). Proven here: multi-chunk pushes land bit-exact in shuffled blocks and
nowhere else, half precision keeps its raw bits, every refusal (geometry, checksum, fence, unknown
request, blocks outside the reservation, malformed streams, a receiver bug, a reservation reclaimed
mid-push) answers the right status with a clear message and leaves the pool untouched, concurrent
pushes all land, reservations complete as their blocks arrive, and an unreachable receiver fails
fast with UNAVAILABLE.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, Tracer

from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer import transport as kv_transport
from splitserve.kv_transfer.grpc_receiver import GrpcKVReceiver, KVTransferServicer
from splitserve.kv_transfer.grpc_transport import (
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    GrpcKVSender,
)
from splitserve.kv_transfer.transport import Peer, Push, PushResult, TransferError
from splitserve.kv_transfer.wire import MAX_CHUNK_BYTES, CacheLayout, crc32c, make_header
from splitserve.protos.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

pytestmark = pytest.mark.slow

# One block over all layers: 4 layers * 2 (k, v) * 16 tokens * 4 heads * 64 dims * 4 B = 128 KiB
# in float32, so 72 blocks are 9 MiB: three data messages of at most 4 MiB.
NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 96, 4, 16, 4, 64
GEOMETRY = {
    "num_layers": NUM_LAYERS,
    "block_size": BLOCK_SIZE,
    "num_kv_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
}
BLOCK_BYTES = 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # float32: 128 KiB
TIMEOUT_S = 20.0


def make_pool(
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    num_blocks: int = NUM_BLOCKS,
    **geometry: int,
) -> torch.Tensor:
    """A block-major pool: zeros, or (with a seed) random raw bits in every element, NaN
    payloads, -0.0 and subnormals included, so only a byte-exact copy compares equal."""
    g = {**GEOMETRY, **geometry}
    shape = (num_blocks, g["num_layers"], 2, g["block_size"], g["num_kv_heads"], g["head_dim"])
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)
    )


def make_connector(pool: torch.Tensor) -> KVConnector:
    num_blocks, block_size = pool.shape[0], pool.shape[3]
    return KVConnector(KVCache.over(pool), BlockManager(num_blocks, block_size), block_size)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t`: compares NaNs and signed zeros bit for bit."""
    return t.contiguous().view(torch.uint8)


@dataclass
class Receiver:
    """A decode worker's receiving half: its pool, reservations and the served servicer."""

    pool: torch.Tensor
    book: ReservationBook
    server: GrpcKVReceiver
    pushes: list[tuple[int, float, bool]] = field(default_factory=list)  # on_push reports

    @property
    def servicer(self) -> KVTransferServicer:
        return self.server.servicer

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def peer(self) -> Peer:
        """As a sender sees it: the worker's own address elsewhere, the receiver's published."""
        return Peer("decode-0", "127.0.0.1:1", self.server.endpoint())

    def reserve(
        self, request_id: str, fence: int, block_ids: Sequence[int], num_cached_tokens: int = 0
    ) -> LocalReservation:
        res = LocalReservation(request_id, fence, tuple(block_ids), num_cached_tokens, BLOCK_SIZE)
        self.book.add(res)
        return res

    def snapshot(self) -> torch.Tensor:
        return raw(self.pool).clone()

    def assert_unchanged(self, before: torch.Tensor) -> None:
        assert torch.equal(raw(self.pool), before), "the receiver's pool changed"


def start_receiver(
    dtype: torch.dtype = torch.float32,
    tracer: Tracer | None = None,
    **geometry: int,
) -> Receiver:
    pool = make_pool(dtype, **geometry)
    book = ReservationBook()
    pushes: list[tuple[int, float, bool]] = []
    server = GrpcKVReceiver(
        make_connector(pool), book, "decode-0", tracer, lambda n, s, ok: pushes.append((n, s, ok))
    )
    return Receiver(pool, book, server, pushes)


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    """Start receivers on demand; every one is stopped at the end of the test."""
    started: list[Receiver] = []

    def start(dtype: torch.dtype = torch.float32, **kwargs: object) -> Receiver:
        started.append(start_receiver(dtype, **kwargs))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for r in started:
        r.server.close()


@pytest.fixture
def receiver(receivers: Callable[..., Receiver]) -> Receiver:
    return receivers()


@pytest.fixture
def senders() -> Iterator[Callable[..., GrpcKVSender]]:
    """Build senders (over their own pools) on demand; all are closed at the end of the test."""
    made: list[GrpcKVSender] = []

    def make(pool: torch.Tensor, cls: type[GrpcKVSender] = GrpcKVSender) -> GrpcKVSender:
        made.append(cls(make_connector(pool)))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def src_pool() -> torch.Tensor:
    return make_pool(seed=1)


@pytest.fixture
def sender(senders: Callable[..., GrpcKVSender], src_pool: torch.Tensor) -> GrpcKVSender:
    return senders(src_pool)


def push_of(request_id: str, fence: int, src: Sequence[int], dst: Sequence[int]) -> Push:
    return Push(request_id, fence, tuple(src), tuple(dst), len(dst) * BLOCK_SIZE)


def assert_landed(
    receiver: Receiver, src_pool: torch.Tensor, src: Sequence[int], dst: Sequence[int]
) -> None:
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(raw(receiver.pool[d]), raw(src_pool[s])), (s, d)


def refused(sender: GrpcKVSender, peer: Peer, push: Push) -> TransferError:
    with pytest.raises(TransferError) as info:
        sender.push(peer, push, timeout_s=TIMEOUT_S)
    return info.value


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


# -- refusals ------------------------------------------------------------------------------------


MISMATCHES = [
    # (sender pool, what the refusal must say); the receiver is float32 of GEOMETRY
    ({"dtype": torch.bfloat16}, "dtype 'bfloat16' does not match the receiver's 'float32'"),
    ({"dtype": torch.float16}, "dtype 'float16' does not match the receiver's 'float32'"),
    ({"block_size": 8}, "block_size 8 does not match the receiver's 16"),
    ({"num_kv_heads": 2}, "num_kv_heads 2 does not match the receiver's 4"),
    ({"head_dim": 32}, "head_dim 32 does not match the receiver's 64"),
    ({"num_layers": 2}, "layers [0, 2) but a block carries all 4 layers"),
]


@pytest.mark.parametrize(("pool_args", "message"), MISMATCHES)
@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "unknown-request"])
def test_a_dtype_or_geometry_mismatch_is_refused_with_a_clear_message(
    receiver: Receiver,
    senders: Callable[..., GrpcKVSender],
    pool_args: dict,
    message: str,
    reserved: bool,
) -> None:
    """Refused INVALID_ARGUMENT, and before the reservation is looked at: a push that could
    never fit is bad input even for a request this receiver does not know."""
    sender = senders(make_pool(seed=3, **pool_args))
    res = receiver.reserve("req", fence=1, block_ids=[4, 5]) if reserved else None
    before = receiver.snapshot()

    error = refused(sender, receiver.peer, push_of("req", 1, [0, 1], [4, 5]))

    assert error.status == "INVALID_ARGUMENT"
    assert message in str(error)
    assert "'req'" in str(error) and receiver.address in str(error)  # says which push failed
    receiver.assert_unchanged(before)
    assert res is None or not res.received
    assert [ok for _, _, ok in receiver.pushes] == [False]


class CorruptingSender(GrpcKVSender):
    """Flips one byte of a copy of the payload after the checksum was taken (once)."""

    corrupt_next = True

    def _send(
        self,
        address: str,
        header: kv_transfer_pb2.KVTransferHeader,
        payload: memoryview,
        timeout_s: float,
        *args,
    ) -> PushResult:
        if self.corrupt_next:
            self.corrupt_next = False
            copy = bytearray(payload)
            copy[len(copy) // 3] ^= 0x40
            payload = memoryview(copy)
        return super()._send(address, header, payload, timeout_s, *args)


def test_a_corrupted_payload_is_refused_and_the_same_server_then_accepts_a_good_push(
    receiver: Receiver, senders: Callable[..., GrpcKVSender], src_pool: torch.Tensor
) -> None:
    sender = senders(src_pool, CorruptingSender)
    res = receiver.reserve("req", fence=1, block_ids=[10, 61, 12, 40])
    push = push_of("req", 1, [3, 4, 5, 80], [10, 61, 12, 40])
    before = receiver.snapshot()

    error = refused(sender, receiver.peer, push)

    assert error.status == "INVALID_ARGUMENT"
    assert "checksum mismatch" in str(error)
    receiver.assert_unchanged(before)
    assert not res.received and not res.complete
    sender.push(receiver.peer, push, timeout_s=TIMEOUT_S)  # same sender, same server
    assert_landed(receiver, src_pool, push.src_block_ids, push.dst_block_ids)
    assert res.complete
    assert [ok for _, _, ok in receiver.pushes] == [False, True]


@pytest.mark.parametrize("replaced_by", [None, 7], ids=["older-fence", "re-reserved"])
def test_a_stale_fence_is_refused_with_failed_precondition(
    receiver: Receiver, sender: GrpcKVSender, replaced_by: int | None
) -> None:
    receiver.reserve("req", fence=2, block_ids=[0, 1])
    if replaced_by is not None:  # the reservation was re-made with a newer fence
        receiver.reserve("req", fence=replaced_by, block_ids=[0, 1])
    current = replaced_by or 2
    before = receiver.snapshot()

    error = refused(sender, receiver.peer, push_of("req", 1, [0, 1], [0, 1]))

    assert error.status == "FAILED_PRECONDITION"
    assert f"stale fencing token 1 for request 'req' (it holds {current})" in str(error)
    receiver.assert_unchanged(before)


def test_an_unknown_request_is_refused_with_not_found(
    receiver: Receiver, sender: GrpcKVSender
) -> None:
    receiver.reserve("other", fence=1, block_ids=[0])
    before = receiver.snapshot()
    error = refused(sender, receiver.peer, push_of("ghost", 1, [0], [0]))
    assert error.status == "NOT_FOUND"
    assert "no reservation for request 'ghost'" in str(error)
    receiver.assert_unchanged(before)


@pytest.mark.parametrize(
    ("dst", "message"),
    [
        ([1, 2], "destination blocks [2] are not reserved for this request"),
        # The first block is the receiver's cached prefix: not the sender's to fill.
        ([0, 1], "destination blocks [0] are not reserved for this request"),
        ([1, NUM_BLOCKS + 3], f"destination blocks [{NUM_BLOCKS + 3}] are outside the pool's"),
        ([1, 1], "repeated destination blocks in [1, 1]"),
    ],
    ids=["unreserved", "cached-prefix", "outside-pool", "repeated"],
)
def test_blocks_outside_the_reservation_are_refused(
    receiver: Receiver, sender: GrpcKVSender, dst: list[int], message: str
) -> None:
    res = receiver.reserve("req", fence=1, block_ids=[0, 1, 3], num_cached_tokens=BLOCK_SIZE)
    assert res.needed == {1, 3}
    before = receiver.snapshot()

    error = refused(sender, receiver.peer, push_of("req", 1, [5, 6], dst))

    assert error.status == "INVALID_ARGUMENT"
    assert message in str(error)
    receiver.assert_unchanged(before)
    assert not res.received


def raw_push(
    address: str,
    messages: Sequence[kv_transfer_pb2.KVTransferMessage],
    options: Sequence[tuple[str, int]] = CHANNEL_OPTIONS,
) -> grpc.RpcError | kv_transfer_pb2.PushBlocksResponse:
    """Stream hand-made messages with a bare stub; the response, or the error it got."""
    with grpc.insecure_channel(address, options=options) as channel:
        stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
        try:
            return stub.PushBlocks(iter(messages), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc


def good_stream(
    src_pool: torch.Tensor, src: Sequence[int], dst: Sequence[int], request_id: str, fence: int
) -> tuple[kv_transfer_pb2.KVTransferHeader, bytes]:
    payload = bytes(raw(src_pool[list(src)]).numpy())
    layout = CacheLayout.of(make_connector(src_pool).region())
    header = make_header(
        request_id, fence, layout, dst, len(payload), crc32c(payload), len(dst) * BLOCK_SIZE
    )
    return header, payload


def test_malformed_streams_are_refused_with_invalid_argument(
    receiver: Receiver, src_pool: torch.Tensor
) -> None:
    res = receiver.reserve("req", fence=1, block_ids=[8, 2])
    header, payload = good_stream(src_pool, [0, 1], [8, 2], "req", fence=1)
    head = kv_transfer_pb2.KVTransferMessage(header=header)
    data = kv_transfer_pb2.KVTransferMessage(data=payload)

    def chunk(b: bytes) -> kv_transfer_pb2.KVTransferMessage:
        return kv_transfer_pb2.KVTransferMessage(data=b)

    cases = [
        ("must start with the header", [data]),
        ("must start with the header", []),
        ("must start with the header", [kv_transfer_pb2.KVTransferMessage(), head, data]),
        ("a second header in one PushBlocks stream", [head, head, data]),
        ("a second header in one PushBlocks stream", [head, data, head]),
        ("an empty message in a PushBlocks stream", [head, kv_transfer_pb2.KVTransferMessage()]),
        ("more data than declared", [head, data, chunk(b"x")]),
        ("more data than declared", [head, chunk(payload + b"x")]),
        ("stream ended after 10 of", [head, chunk(payload[:10])]),
        (f"stream ended after 0 of {len(payload)} payload bytes", [head]),
        (f"stream ended after {len(payload) - 1} of", [head, chunk(payload[:-1])]),
        (
            f"data message of {MAX_CHUNK_BYTES + 1} bytes exceeds {MAX_CHUNK_BYTES}",
            [head, chunk(bytes(MAX_CHUNK_BYTES + 1))],
        ),
    ]
    before = receiver.snapshot()
    for message, stream in cases:
        error = raw_push(receiver.address, stream)
        assert isinstance(error, grpc.RpcError), message
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (message, error.details())
        assert message in error.details(), (message, error.details())
    receiver.assert_unchanged(before)
    assert not res.received
    assert [ok for _, _, ok in receiver.pushes] == [False] * len(cases)

    # Still serving, and any chunk boundaries are fine as long as the bytes add up.
    cuts = [0, 1, 7, 4096, len(payload) // 2, len(payload)]
    pieces = [chunk(payload[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    response = raw_push(receiver.address, [head, *pieces])
    assert isinstance(response, kv_transfer_pb2.PushBlocksResponse), response
    assert (response.num_blocks, response.num_bytes) == (2, len(payload))
    assert_landed(receiver, src_pool, [0, 1], [8, 2])
    assert res.complete


def test_a_large_push_goes_as_parallel_streams_that_together_land_every_block(
    receiver: Receiver, src_pool: torch.Tensor
) -> None:
    rng = random.Random(11)
    src = rng.sample(range(NUM_BLOCKS), 90)  # 11.25 MiB: three streams of >= 2 MiB
    dst = rng.sample(range(NUM_BLOCKS), 90)
    res = receiver.reserve("lanes", fence=2, block_ids=dst)
    sender = GrpcKVSender(make_connector(src_pool), streams=3, min_stream_bytes=2 << 20)
    try:
        result = sender.push(receiver.peer, push_of("lanes", 2, src, dst), timeout_s=TIMEOUT_S)
    finally:
        sender.close()
    assert result == PushResult(num_blocks=90, num_bytes=90 * BLOCK_BYTES)
    assert sorted(n for n, _, ok in receiver.pushes if ok) == [30 * BLOCK_BYTES] * 3
    assert_landed(receiver, src_pool, src, dst)
    assert res.complete


def test_the_server_refuses_messages_over_its_8_mib_limit(
    receiver: Receiver, src_pool: torch.Tensor
) -> None:
    """The receiver caps messages at 8 MiB, the transport's MAX_MESSAGE_BYTES: a 4 MiB chunk
    fits with headroom; a sender that ignored the chunk limit gets RESOURCE_EXHAUSTED."""
    assert MAX_MESSAGE_BYTES == 8 << 20 and dict(CHANNEL_OPTIONS) == {
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    }
    receiver.reserve("req", fence=1, block_ids=[0])
    header, _ = good_stream(src_pool, [0], [0], "req", fence=1)
    big = kv_transfer_pb2.KVTransferMessage(data=bytes(MAX_MESSAGE_BYTES + 1))
    options = [("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES)]
    error = raw_push(
        receiver.address, [kv_transfer_pb2.KVTransferMessage(header=header), big], options
    )
    assert isinstance(error, grpc.RpcError)
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not receiver.pool.any()


def test_a_failing_landing_is_an_internal_error_not_a_dead_server(
    receiver: Receiver,
    sender: GrpcKVSender,
    src_pool: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    res = receiver.reserve("req", fence=1, block_ids=[6, 2])
    push = push_of("req", 1, [0, 1], [6, 2])
    before = receiver.snapshot()

    def broken(*_: object) -> None:
        raise RuntimeError("disk on fire")

    with monkeypatch.context() as patch:
        patch.setattr(receiver.book, "hold", broken)
        error = refused(sender, receiver.peer, push)

    assert error.status == "INTERNAL"
    assert "internal error receiving KV: RuntimeError('disk on fire')" in str(error)
    receiver.assert_unchanged(before)
    assert not res.received
    sender.push(receiver.peer, push, timeout_s=TIMEOUT_S)  # the server keeps serving
    assert_landed(receiver, src_pool, [0, 1], [6, 2])
    assert res.complete


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
