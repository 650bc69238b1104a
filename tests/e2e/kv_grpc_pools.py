"""Real KV pools for the gRPC transport's tests: block-major pools of random raw bits behind
real `KVConnector`s (no model), a decode worker's receiving half (`GrpcKVReceiver` over a real
`ReservationBook`), and what the tests check with (`tests/e2e/conftest.py` starts receivers
and senders, and stops them after each test).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from opentelemetry.trace import Tracer

from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer.grpc_receiver import GrpcKVReceiver, KVTransferServicer
from splitserve.kv_transfer.grpc_transport import GrpcKVSender
from splitserve.kv_transfer.transport import Peer, Push, TransferError

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
