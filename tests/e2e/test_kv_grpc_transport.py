"""KV blocks over a real gRPC server on loopback: bit-exact landing and every refusal."""

from __future__ import annotations

import socket
import threading
from collections.abc import Collection, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
import torch

from splitserve.kv_transfer import wire
from splitserve.kv_transfer.grpc_transport import (
    CHANNEL_OPTIONS,
    GrpcKVTransport,
    KVTransferServicer,
)
from splitserve.kv_transfer.transport import TRANSPORTS, KVTransport, TransferError, get_transport
from splitserve.kv_transfer.wire import Buffer, CacheLayout, PushRefused
from splitserve.protos.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

# One block over all layers is 2 * 4 * 16 * 4 * 64 * 4 B = 128 KiB (float32).
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 4, 64, 16, 4, 64
TIMEOUT_S = 30.0


@dataclass
class Reservation:
    fence: int
    block_ids: frozenset[int]


class CacheReceiver:
    """A decode side in miniature: reservations with fences over real cache tensors."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(NUM_LAYERS)]
        self.reservations: dict[str, Reservation] = {}
        self.num_tokens: dict[str, int] = {}
        self.num_pushes = 0
        self._lock = threading.Lock()

    def reserve(self, request_id: str, fence: int, block_ids: Collection[int]) -> None:
        self.reservations[request_id] = Reservation(fence, frozenset(block_ids))

    def layout(self) -> CacheLayout:
        return CacheLayout.from_kv_caches(self.kv_caches)

    def _reservation(self, header: kv_transfer_pb2.KVTransferHeader) -> Reservation:
        res = self.reservations.get(header.request_id)
        if res is None:
            raise PushRefused(grpc.StatusCode.NOT_FOUND, f"no reservation {header.request_id!r}")
        if res.fence != header.fence:
            raise PushRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale fence {header.fence} for {header.request_id!r} (now {res.fence})",
            )
        return res

    def check_push(self, header: kv_transfer_pb2.KVTransferHeader) -> Collection[int]:
        with self._lock:
            return self._reservation(header).block_ids

    def on_blocks(self, header: kv_transfer_pb2.KVTransferHeader, payload: Buffer) -> None:
        with self._lock:
            self._reservation(header)  # re-checked: the fence may have moved meanwhile
            # The servicer has verified size and checksum already.
            wire.unpack_into(self.kv_caches, header, payload, verify=False)
            self.num_tokens[header.request_id] = header.num_tokens_after
            self.num_pushes += 1

    def snapshot(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.kv_caches]


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> CacheReceiver:
    return CacheReceiver(getattr(request, "param", torch.float32))


@pytest.fixture
def address(receiver: CacheReceiver) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=CHANNEL_OPTIONS)
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(receiver), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


@pytest.fixture
def transport() -> Iterator[KVTransport]:
    with get_transport("grpc") as t:
        yield t


def sender_caches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [torch.randn(shape).to(dtype) for _ in range(NUM_LAYERS)]


def prepare(
    src: list[torch.Tensor], src_ids: list[int], dst_ids: list[int], request_id: str, fence: int
) -> tuple[kv_transfer_pb2.KVTransferHeader, bytes]:
    payload = wire.pack_blocks(src, src_ids)
    layout = CacheLayout.from_kv_caches(src)
    tokens = len(dst_ids) * BLOCK_SIZE
    header = wire.make_header(request_id, fence, layout, dst_ids, payload, 0, NUM_LAYERS, tokens)
    return header, payload


def assert_landed(
    receiver: CacheReceiver, src: list[torch.Tensor], src_ids: list[int], dst_ids: list[int]
) -> None:
    for layer in range(NUM_LAYERS):
        assert torch.equal(receiver.kv_caches[layer][:, dst_ids], src[layer][:, src_ids])


def assert_unchanged(receiver: CacheReceiver, before: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(receiver.kv_caches, before, strict=True))


def test_push_over_4_mib_lands_bit_exact(
    receiver: CacheReceiver, address: str, transport: KVTransport
) -> None:
    src = sender_caches()
    src_ids = list(range(0, 60, 2))[::-1]  # 30 scattered blocks, 3.75 MiB each way ...
    src_ids += [1, 3, 5, 7, 9, 11]  # ... plus 6 more: 36 blocks = 4.5 MiB
    dst_ids = list(range(NUM_BLOCKS - 1, 0, -2)) + [0, 10, 20, 30]
    receiver.reserve("big", fence=5, block_ids=dst_ids)
    header, payload = prepare(src, src_ids, dst_ids, "big", fence=5)
    assert len(payload) > 4 << 20

    result = transport.send(address, header, payload, timeout_s=TIMEOUT_S)

    assert (result.num_blocks, result.num_bytes) == (len(dst_ids), len(payload))
    assert_landed(receiver, src, src_ids, dst_ids)
    assert receiver.num_tokens["big"] == len(dst_ids) * BLOCK_SIZE
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_ids))
    assert all(not c[:, untouched].any() for c in receiver.kv_caches)


@pytest.mark.parametrize("receiver", [torch.bfloat16, torch.float16], indirect=True)
def test_half_precision_blocks_cross_bit_exact(
    receiver: CacheReceiver, address: str, transport: KVTransport
) -> None:
    dtype = receiver.kv_caches[0].dtype
    src = sender_caches(dtype)
    receiver.reserve("half", fence=3, block_ids=[40, 7, 22])
    header, payload = prepare(src, [1, 50, 9], [40, 7, 22], "half", fence=3)
    transport.send(address, header, payload, timeout_s=TIMEOUT_S)
    for layer in range(NUM_LAYERS):
        got = receiver.kv_caches[layer][:, [40, 7, 22]].contiguous().view(torch.int16)
        assert torch.equal(got, src[layer][:, [1, 50, 9]].contiguous().view(torch.int16))


def test_a_dtype_mismatch_is_refused_with_a_clear_message(
    address: str, transport: KVTransport
) -> None:
    src = sender_caches(torch.bfloat16)
    header, payload = prepare(src, [0], [0], "bf16", fence=1)
    with pytest.raises(TransferError, match="dtype 'bfloat16'") as info:
        transport.send(address, header, payload, timeout_s=TIMEOUT_S)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_corrupted_payload_is_refused_and_the_same_server_then_accepts_a_good_push(
    receiver: CacheReceiver, address: str, transport: KVTransport
) -> None:
    src = sender_caches()
    receiver.reserve("req", fence=1, block_ids=[10, 11, 12])
    header, payload = prepare(src, [3, 4, 5], [10, 11, 12], "req", fence=1)
    corrupted = bytearray(payload)
    corrupted[len(corrupted) // 3] ^= 0x40
    before = receiver.snapshot()

    with pytest.raises(TransferError, match="checksum mismatch") as info:
        transport.send(address, header, corrupted, timeout_s=TIMEOUT_S)

    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "checksum mismatch" in info.value.details
    assert_unchanged(receiver, before)
    assert receiver.num_pushes == 0
    transport.send(address, header, payload, timeout_s=TIMEOUT_S)
    assert_landed(receiver, src, [3, 4, 5], [10, 11, 12])
    assert receiver.num_pushes == 1


def test_stale_fence_is_refused_with_failed_precondition(
    receiver: CacheReceiver, address: str, transport: KVTransport
) -> None:
    src = sender_caches()
    receiver.reserve("req", fence=2, block_ids=[0, 1])
    header, payload = prepare(src, [0, 1], [0, 1], "req", fence=1)
    before = receiver.snapshot()
    with pytest.raises(TransferError, match="stale fence 1") as info:
        transport.send(address, header, payload, timeout_s=TIMEOUT_S)
    assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert_unchanged(receiver, before)


def test_unknown_request_is_refused_with_not_found(address: str, transport: KVTransport) -> None:
    header, payload = prepare(sender_caches(), [0], [0], "ghost", fence=1)
    with pytest.raises(TransferError) as info:
        transport.send(address, header, payload, timeout_s=TIMEOUT_S)
    assert info.value.code is grpc.StatusCode.NOT_FOUND


def test_blocks_outside_the_reservation_are_refused(
    receiver: CacheReceiver, address: str, transport: KVTransport
) -> None:
    receiver.reserve("req", fence=1, block_ids=[0, 1])
    header, payload = prepare(sender_caches(), [0, 1], [1, 2], "req", fence=1)
    with pytest.raises(TransferError, match=r"\[2\] are not reserved") as info:
        transport.send(address, header, payload, timeout_s=TIMEOUT_S)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert receiver.num_pushes == 0


def push_raw(address: str, messages: list[kv_transfer_pb2.KVTransferMessage]) -> grpc.RpcError:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.PushBlocks(iter(messages), timeout=TIMEOUT_S)
    return info.value


def test_malformed_streams_are_refused_with_invalid_argument(
    receiver: CacheReceiver, address: str, transport: KVTransport
) -> None:
    receiver.reserve("req", fence=1, block_ids=[0, 1])
    header, payload = prepare(sender_caches(), [0, 1], [0, 1], "req", fence=1)
    head = kv_transfer_pb2.KVTransferMessage(header=header)
    data = kv_transfer_pb2.KVTransferMessage(data=payload)
    cases = [
        ("must start with the header", [data]),
        ("must start with the header", []),
        ("a second header", [head, head, data]),
        ("more data than declared", [head, data, kv_transfer_pb2.KVTransferMessage(data=b"x")]),
        ("stream ended after 10 of", [head, kv_transfer_pb2.KVTransferMessage(data=payload[:10])]),
        ("an empty message", [head, kv_transfer_pb2.KVTransferMessage()]),
    ]
    for message, stream in cases:
        error = push_raw(address, stream)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in error.details(), (message, error.details())
    assert receiver.num_pushes == 0
    assert not any(c.any() for c in receiver.kv_caches)
    transport.send(address, header, payload, timeout_s=TIMEOUT_S)  # still serving
    assert receiver.num_pushes == 1


def test_a_failing_receiver_is_an_internal_error_not_a_dead_server(
    receiver: CacheReceiver, address: str, transport: KVTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver.reserve("req", fence=1, block_ids=[0])
    header, payload = prepare(sender_caches(), [0], [0], "req", fence=1)

    def broken(*_: object) -> None:
        raise RuntimeError("disk on fire")

    with monkeypatch.context() as patch:
        patch.setattr(receiver, "on_blocks", broken)
        with pytest.raises(TransferError, match="disk on fire") as info:
            transport.send(address, header, payload, timeout_s=TIMEOUT_S)
    assert info.value.code is grpc.StatusCode.INTERNAL
    transport.send(address, header, payload, timeout_s=TIMEOUT_S)
    assert receiver.num_pushes == 1


def test_concurrent_pushes_from_four_threads_all_land(
    receiver: CacheReceiver, address: str, transport: KVTransport
) -> None:
    src = sender_caches()
    jobs = []
    for t in range(4):
        dst_ids = list(range(t, NUM_BLOCKS, 4))[:12]  # interleaved across requests
        src_ids = list(range(12 * t, 12 * t + 12))[::-1]
        receiver.reserve(f"r{t}", fence=t + 1, block_ids=dst_ids)
        jobs.append((src_ids, dst_ids, *prepare(src, src_ids, dst_ids, f"r{t}", fence=t + 1)))

    with futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(
            pool.map(lambda j: transport.send(address, j[2], j[3], timeout_s=TIMEOUT_S), jobs)
        )

    assert [r.num_blocks for r in results] == [12] * 4
    assert receiver.num_pushes == 4
    for src_ids, dst_ids, _, _ in jobs:
        assert_landed(receiver, src, src_ids, dst_ids)


def test_transport_factory_and_unreachable_receiver() -> None:
    assert "grpc" in TRANSPORTS
    with pytest.raises(ValueError, match="unknown KV transport 'carrier-pigeon'.*grpc"):
        get_transport("carrier-pigeon")
    transport = get_transport("grpc")
    assert isinstance(transport, GrpcKVTransport)
    header, payload = prepare(sender_caches(), [0], [0], "req", fence=1)
    with socket.socket() as sock:  # a port that was free a moment ago: nobody listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TransferError) as info:
        transport.send(f"127.0.0.1:{port}", header, payload, timeout_s=5.0)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    transport.close()
    with pytest.raises(RuntimeError, match="closed"):
        transport.send(f"127.0.0.1:{port}", header, payload, timeout_s=5.0)
