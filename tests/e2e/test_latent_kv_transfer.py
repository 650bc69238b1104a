"""MLA latent pools (DeepSeek-V2/V3: one plane of one latent-wide row per token and layer) over
the real transports: a block is one contiguous run (one NIXL descriptor, one slice of a gRPC
payload) and lands bit-exact; a pool of keys and values, or of latents of another width, is
refused by name before anything lands, over gRPC (the header) and NIXL (the handshake)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.kv_transfer.grpc_receiver import GrpcKVReceiver
from splitserve.kv_transfer.grpc_transport import GrpcKVSender
from splitserve.kv_transfer.nixl_receiver import NixlReceiver
from splitserve.kv_transfer.nixl_transport import NixlSender
from splitserve.kv_transfer.transport import Peer, Push, TransferError
from splitserve.kv_transfer.wire import LATENT_LAYOUT, CacheLayout
from tests.e2e.kv_grpc_pools import make_connector, raw
from tests.e2e.nixl_peer import RecordingLanding

pytestmark = pytest.mark.slow

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE = 32, 3, 16
HEADS, HEAD_DIM = 4, 10  # a pool of keys and values as large as latents 80 wide
TIMEOUT_S = 20.0


def pool(width: int | None = 40, seed: int | None = None) -> torch.Tensor:
    """A latent pool `width` wide (None: keys and values of HEADS x HEAD_DIM), float32: zeros or
    random raw bits."""
    page = (1, BLOCK_SIZE, 1, width) if width else (2, BLOCK_SIZE, HEADS, HEAD_DIM)
    shape = (NUM_BLOCKS, NUM_LAYERS, *page)
    if seed is None:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (torch.Size(shape).numel() * 4,), dtype=torch.uint8, generator=gen)
    return bits.view(torch.float32).view(shape)


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[torch.Tensor, ReservationBook, GrpcKVReceiver]]:
    dst, book = pool(), ReservationBook()
    receiver = GrpcKVReceiver(make_connector(dst), book, "decode-0")
    yield dst, book, receiver
    receiver.close()


def reserve(book: ReservationBook, request_id: str, blocks: list[int]) -> None:
    book.add(LocalReservation(request_id, 1, tuple(blocks), 0, BLOCK_SIZE))


def test_a_latent_pool_is_one_plane_of_latent_rows_per_block() -> None:
    region = make_connector(pool()).region()
    layout = CacheLayout.of(region)
    assert region.page == (1, BLOCK_SIZE, 1, 40) and layout.layout == LATENT_LAYOUT
    assert layout.block_shape == (NUM_LAYERS, 1, BLOCK_SIZE, 1, 40)
    # block_size x (kv_lora_rank + qk_rope_head_dim) x element size x layers, contiguous.
    assert layout.block_bytes == region.block_bytes == BLOCK_SIZE * 40 * 4 * NUM_LAYERS


def test_latent_blocks_land_bit_exact_over_grpc(grpc_receiver) -> None:
    dst_pool, book, receiver = grpc_receiver
    src_pool = pool(seed=3)
    rng = random.Random(5)
    src, dst = rng.sample(range(NUM_BLOCKS), 7), rng.sample(range(NUM_BLOCKS), 7)
    reserve(book, "req-1", dst)
    sender = GrpcKVSender(make_connector(src_pool))
    try:
        peer = Peer("decode-0", "127.0.0.1:1", receiver.endpoint())
        result = sender.push(peer, Push("req-1", 1, tuple(src), tuple(dst), 7 * BLOCK_SIZE), 20)
    finally:
        sender.close()
    assert (result.num_blocks, result.num_bytes) == (7, 7 * BLOCK_SIZE * 40 * 4 * NUM_LAYERS)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(raw(dst_pool[d]), raw(src_pool[s])), (s, d)


@pytest.mark.parametrize(
    ("src_width", "message"),
    [
        (None, "the payload holds keys and values ('block,layer,kv,slot,head,dim') but the "
               "receiver's pool holds MLA latents"),
        (48, "head_dim (the latent's width) 48 does not match the receiver's 40"),
    ],
)  # fmt: skip
def test_grpc_refuses_another_pool_kind_or_latent_width(grpc_receiver, src_width, message) -> None:
    dst_pool, book, receiver = grpc_receiver
    reserve(book, "req-2", [0, 1])
    before = raw(dst_pool).clone()
    sender = GrpcKVSender(make_connector(pool(src_width, seed=4)))
    try:
        peer = Peer("decode-0", "127.0.0.1:1", receiver.endpoint())
        with pytest.raises(TransferError) as refused:
            sender.push(peer, Push("req-2", 1, (0, 1), (0, 1), 2 * BLOCK_SIZE), TIMEOUT_S)
    finally:
        sender.close()
    assert refused.value.status == "INVALID_ARGUMENT"
    assert message in str(refused.value)
    assert torch.equal(raw(dst_pool), before), "a refused push changed the pool"


@pytest.fixture(scope="module")
def nixl_receiver() -> Iterator[tuple[torch.Tensor, RecordingLanding, Peer]]:
    """A real NIXL receiver (its own agent, UCX) over a latent pool 80 wide."""
    dst, landing = pool(80), RecordingLanding()
    receiver = NixlReceiver(make_connector(dst), landing, "decode-0")
    yield dst, landing, Peer("decode-0", "unused:0", receiver.endpoint())
    receiver.close()


def test_latent_blocks_land_bit_exact_over_nixl(nixl_receiver) -> None:
    dst_pool, landing, peer = nixl_receiver
    src_pool = pool(80, seed=6)
    src, dst = [5, 2, 9], [11, 12, 3]
    with landing.lock:
        landing.reservations["req-3"] = (1, frozenset(dst), set())
    sender = NixlSender(make_connector(src_pool), "prefill-0")
    try:
        result = sender.push(peer, Push("req-3", 1, tuple(src), tuple(dst), 48), TIMEOUT_S)
    finally:
        sender.close()
    block_bytes = BLOCK_SIZE * 80 * 4 * NUM_LAYERS
    assert (result.num_blocks, result.num_bytes) == (3, 3 * block_bytes)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(raw(dst_pool[d]), raw(src_pool[s])), (s, d)


def test_nixl_refuses_keys_and_values_into_latents_of_the_same_size(nixl_receiver) -> None:
    """Blocks of keys and values as large as the receiver's latent blocks: refused at the
    handshake (the page it publishes), before any write."""
    dst_pool, landing, peer = nixl_receiver
    before, events = raw(dst_pool).clone(), len(landing.events)
    kv = pool(None, seed=7)
    assert kv[0].numel() == dst_pool[0].numel()
    sender = NixlSender(make_connector(kv), "prefill-1")
    try:
        with pytest.raises(TransferError) as refused:
            sender.push(peer, Push("req-4", 1, (0,), (0,), 16), TIMEOUT_S)
    finally:
        sender.close()
    assert refused.value.status == "FAILED_PRECONDITION"
    assert (
        f"KV blocks hold MLA latents: {NUM_LAYERS} layers x 1 x 16 x 1 x 80 float32, this "
        f"worker's keys and values: {NUM_LAYERS} layers x 2 x 16 x {HEADS} x {HEAD_DIM} float32"
    ) in str(refused.value)
    assert torch.equal(raw(dst_pool), before) and len(landing.events) == events
