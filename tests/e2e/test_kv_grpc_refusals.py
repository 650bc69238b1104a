"""Refusals of the gRPC KV transport, end to end on loopback with real components (the set-up
of `test_kv_grpc_transport.py`, from `kv_grpc_pools.py`): every refusal (geometry, checksum,
fence, unknown request, blocks outside the reservation, malformed streams, messages over the
limit, a receiver bug) answers the right status with a clear message and leaves the pool
untouched, and the same server then serves a good push.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import grpc
import pytest
import torch

from splitserve.kv_transfer.grpc_transport import (
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    GrpcKVSender,
)
from splitserve.kv_transfer.transport import PushResult
from splitserve.kv_transfer.wire import MAX_CHUNK_BYTES, CacheLayout, crc32c, make_header
from splitserve.protos.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.e2e.kv_grpc_pools import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    NUM_BLOCKS,
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
