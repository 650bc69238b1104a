"""The KV wire format of the gRPC transport: block-major payloads, headers, CRC-32C.

A payload is whole pool blocks in `dst_block_ids` order, `[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]` in C order with each element's raw bytes. These tests pin that byte
order, bit-exact round trips through a real `KVConnector` for every supported dtype, every
refusal of `validate_header` / `verify_payload` / `make_header` (each its own error class and a
message naming the problem and the request). The CRC-32C itself: `test_kv_crc32c.py`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.errors import InvalidRequest
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer import wire
from splitserve.kv_transfer.wire import (
    LAYOUT,
    MAX_CHUNK_BYTES,
    BlockNotAllowedError,
    CacheLayout,
    ChecksumError,
    KVTransferError,
    LayoutMismatchError,
    PayloadSizeError,
)
from splitserve.protos.v1 import kv_transfer_pb2

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 12, 3, 4, 2, 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_pool(dtype: torch.dtype, seed: int | None = 0) -> torch.Tensor:
    """A block-major pool; with a seed, every element is random raw bits (NaN payloads, -0.0,
    subnormals and infinities included), so only a byte-exact copy compares equal."""
    shape = (NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def make_connector(pool: torch.Tensor) -> KVConnector:
    return KVConnector(KVCache.over(pool), BlockManager(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)


def f32_layout() -> CacheLayout:
    return CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# -- CacheLayout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_layout_of_an_engine_region_matches_the_pool(dtype: torch.dtype) -> None:
    pool = make_pool(dtype, seed=None)
    region = make_connector(pool).region()
    layout = CacheLayout.of(region)
    assert layout == CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    assert layout.dtype_name == {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                 torch.float16: "float16"}[dtype]  # fmt: skip
    assert wire.DTYPES[layout.dtype_name] is dtype
    assert layout.block_shape == tuple(pool.shape[1:])
    # A block is one contiguous run of the pool: the same size the engine and the region report.
    assert layout.block_bytes == region.block_bytes == pool[0].numel() * pool.element_size()
    assert layout.payload_bytes(5) == 5 * layout.block_bytes
    assert layout.payload_bytes(0) == 0


def test_wire_constants() -> None:
    assert LAYOUT == "block,layer,kv,slot,head,dim"
    assert MAX_CHUNK_BYTES == 4 * 1024 * 1024
    assert set(wire.DTYPES) == {"float32", "float16", "bfloat16", "float8_e4m3fn"}


@pytest.mark.parametrize("field", ["num_layers", "block_size", "num_kv_heads", "head_dim"])
def test_cache_layout_refuses_a_non_positive_dimension(field: str) -> None:
    args = {"num_layers": 2, "block_size": 4, "num_kv_heads": 2, "head_dim": 8}
    args[field] = 0
    with pytest.raises(ValueError, match=f"{field} must be positive, got 0"):
        CacheLayout(**args, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.uint8])
def test_cache_layout_refuses_an_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        CacheLayout(1, 1, 1, 1, dtype)


# -- payload bytes -------------------------------------------------------------------------------


def test_payload_is_block_major_with_each_blocks_layers_keys_then_values() -> None:
    pool = make_pool(torch.float32)
    layout = CacheLayout.of(make_connector(pool).region())
    ids = [7, 2, 10]
    payload = pool.index_select(0, torch.tensor(ids)).contiguous().view(torch.uint8).reshape(-1)
    assert payload.numel() == layout.payload_bytes(len(ids))
    slab = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # one layer's keys (or values) of a block
    for i, block in enumerate(ids):
        for layer in range(NUM_LAYERS):
            for kv in range(2):
                start = i * layout.block_bytes + (2 * layer + kv) * slab
                got = payload[start : start + slab]
                assert torch.equal(got, raw_bits(pool[block, layer, kv]).reshape(-1))


def test_elements_travel_little_endian_as_raw_bits() -> None:
    layout = CacheLayout(1, 1, 1, 1, torch.bfloat16)
    block = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)  # one block: K and V
    assert bytes(block.view(torch.uint8).numpy()) == b"\x80\x3f\x00\xc0"
    assert wire.as_blocks(block.view(torch.uint8), layout).view(-1).tolist() == [1.0, -2.0]
    f32 = CacheLayout(1, 1, 1, 1, torch.float32)
    payload = torch.frombuffer(bytearray(b"\x00\x00\x80\x3f\x00\x00\x00\x00"), dtype=torch.uint8)
    assert wire.as_blocks(payload, f32).view(-1).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_as_blocks_is_a_zero_copy_view_of_the_payload(dtype: torch.dtype) -> None:
    layout = CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    payload = torch.zeros(layout.payload_bytes(3), dtype=torch.uint8)
    blocks = wire.as_blocks(payload, layout)
    assert blocks.shape == (3, *layout.block_shape)
    assert blocks.dtype is dtype
    assert blocks.data_ptr() == payload.data_ptr()
    blocks[1, 2, 1, 3, 1, 7] = 1.0  # writes through to the payload bytes
    assert payload.any()
    empty = wire.as_blocks(torch.zeros(0, dtype=torch.uint8), layout)
    assert empty.shape == (0, *layout.block_shape)


def test_as_blocks_refuses_a_payload_that_is_not_whole_blocks() -> None:
    layout = f32_layout()
    with pytest.raises(RuntimeError):
        wire.as_blocks(torch.zeros(layout.block_bytes + 4, dtype=torch.uint8), layout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_connector_round_trip_is_bit_exact_into_shuffled_blocks(dtype: torch.dtype) -> None:
    """What the transport does end to end, minus the network: read the source blocks into a
    payload, describe it, validate and verify it on the other side, land it."""
    src_pool, dst_pool = make_pool(dtype, seed=1), make_pool(dtype, seed=None)
    sender, receiver = make_connector(src_pool), make_connector(dst_pool)
    layout = CacheLayout.of(sender.region())
    src_ids, dst_ids = [9, 2, 7, 3, 11], [0, 10, 5, 6, 1]

    buf = torch.empty(layout.payload_bytes(len(src_ids)), dtype=torch.uint8)
    sender.read_blocks(src_ids, wire.as_blocks(buf, layout))
    payload = buf.numpy()
    header = wire.make_header("req", 4, layout, dst_ids, payload.nbytes, wire.crc32c(payload), 20)

    wire.validate_header(header, CacheLayout.of(receiver.region()), NUM_BLOCKS, set(dst_ids))
    wire.verify_payload(header, payload)
    receiver.write_blocks(list(header.dst_block_ids), wire.as_blocks(buf, layout))

    for d, s in zip(dst_ids, src_ids, strict=True):
        assert torch.equal(raw_bits(dst_pool[d]), raw_bits(src_pool[s])), (d, s)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert not raw_bits(dst_pool[untouched]).any()
    assert torch.equal(raw_bits(src_pool), raw_bits(make_pool(dtype, seed=1)))  # read-only


# -- make_header ---------------------------------------------------------------------------------


def test_make_header_describes_the_payload_for_the_receiver() -> None:
    layout = CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    size = layout.payload_bytes(3)
    header = wire.make_header("req-1", 2**40, layout, (8, 1, 5), size, 0xDEADBEEF, 37)
    assert isinstance(header, kv_transfer_pb2.KVTransferHeader)
    assert header.request_id == "req-1"
    assert header.fence == 2**40
    assert header.layout == LAYOUT
    assert header.dtype == "bfloat16"
    assert (header.block_size, header.num_kv_heads, header.head_dim) == (4, 2, 8)
    assert (header.layer_start, header.layer_end) == (0, NUM_LAYERS)
    assert list(header.dst_block_ids) == [8, 1, 5]
    assert header.payload_bytes == size
    assert header.crc32c == 0xDEADBEEF
    assert header.num_tokens_after == 37
    # What make_header writes, validate_header accepts (and the header survives the wire).
    again = kv_transfer_pb2.KVTransferHeader.FromString(header.SerializeToString())
    wire.validate_header(again, layout, NUM_BLOCKS, {1, 5, 8})


@pytest.mark.parametrize("payload_bytes", [0, 1, 1535, 1537, 3 * 1536])
def test_make_header_refuses_a_payload_size_that_is_not_the_blocks(payload_bytes: int) -> None:
    layout = f32_layout()  # 1536 bytes a block
    assert layout.block_bytes == 1536
    message = f"payload is {payload_bytes} bytes; 2 blocks are 3072"
    with pytest.raises(PayloadSizeError, match=message):
        wire.make_header("r", 1, layout, [1, 2], payload_bytes, 0, 8)


def test_an_empty_push_is_an_empty_payload() -> None:
    layout = f32_layout()
    header = wire.make_header("req", 1, layout, [], 0, wire.crc32c(b""), 0)
    wire.validate_header(header, layout, NUM_BLOCKS, frozenset())
    wire.verify_payload(header, b"")
    assert header.crc32c == 0


# -- validate_header -----------------------------------------------------------------------------


def good_header(**overrides: object) -> kv_transfer_pb2.KVTransferHeader:
    layout = f32_layout()
    header = wire.make_header("req-7", 3, layout, [4, 5], layout.payload_bytes(2), 0, 8)
    for field, value in overrides.items():
        if field == "dst_block_ids":
            del header.dst_block_ids[:]
            header.dst_block_ids.extend(value)  # type: ignore[arg-type]
        else:
            setattr(header, field, value)
    return header


BAD_HEADERS = [
    # (overrides, error class, what the message must say)
    ({"layout": "layer,kv,block,slot,head,dim"}, LayoutMismatchError,
     "unknown payload layout 'layer,kv,block,slot,head,dim'; "
     "expected 'block,layer,kv,slot,head,dim'"),
    ({"layout": ""}, LayoutMismatchError, "unknown payload layout ''"),
    ({"dtype": "bfloat16"}, LayoutMismatchError,
     "dtype 'bfloat16' does not match the receiver's 'float32'"),
    ({"dtype": "int8"}, LayoutMismatchError, "dtype 'int8' does not match"),
    ({"dtype": ""}, LayoutMismatchError, "dtype '' does not match"),
    ({"block_size": 16}, LayoutMismatchError, "block_size 16 does not match the receiver's 4"),
    ({"num_kv_heads": 4}, LayoutMismatchError, "num_kv_heads 4 does not match the receiver's 2"),
    ({"head_dim": 64}, LayoutMismatchError, "head_dim 64 does not match the receiver's 8"),
    ({"layer_start": 1}, LayoutMismatchError,
     "layers [1, 3) but a block carries all 3 layers"),
    ({"layer_end": 2}, LayoutMismatchError, "layers [0, 2) but a block carries all 3 layers"),
    ({"layer_end": 4}, LayoutMismatchError, "layers [0, 4) but a block carries all 3 layers"),
    ({"layer_start": 3, "layer_end": 1}, LayoutMismatchError, "layers [3, 1)"),
    ({"dst_block_ids": [4, 4]}, BlockNotAllowedError, "repeated destination blocks in [4, 4]"),
    ({"dst_block_ids": [4, NUM_BLOCKS]}, BlockNotAllowedError,
     f"destination blocks [{NUM_BLOCKS}] are outside the pool's {NUM_BLOCKS}"),
    ({"dst_block_ids": [4, 9]}, BlockNotAllowedError,
     "destination blocks [9] are not reserved for this request"),
    ({"dst_block_ids": [3, 5]}, BlockNotAllowedError, "[3] are not reserved"),
    ({"payload_bytes": 1}, PayloadSizeError, "payload_bytes 1 but 2 blocks are 3072"),
    ({"payload_bytes": 3 * 1536}, PayloadSizeError, "payload_bytes 4608 but 2 blocks are 3072"),
    ({"payload_bytes": 0}, PayloadSizeError, "payload_bytes 0 but 2 blocks are 3072"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "error", "message"), BAD_HEADERS)
def test_validate_header_refuses_with_a_clear_message(
    overrides: dict, error: type[KVTransferError], message: str
) -> None:
    with pytest.raises(error) as info:
        wire.validate_header(good_header(**overrides), f32_layout(), NUM_BLOCKS, {4, 5, 6})
    assert message in str(info.value)
    assert str(info.value).startswith("req-7: ")  # names the request
    # Every refusal is the caller's bad input: INVALID_ARGUMENT.
    assert isinstance(info.value, KVTransferError)
    assert isinstance(info.value, InvalidRequest)
    assert isinstance(info.value, ValueError)
    assert info.value.status == "INVALID_ARGUMENT"


def test_validate_header_accepts_a_good_header_whatever_collection_holds_the_reservation() -> None:
    layout = f32_layout()
    for allowed in ([4, 5], {4, 5, 6}, frozenset({5, 4}), range(12), None):
        wire.validate_header(good_header(), layout, NUM_BLOCKS, allowed)


def test_validate_header_without_a_reservation_still_refuses_blocks_outside_the_pool() -> None:
    layout = f32_layout()
    wire.validate_header(good_header(dst_block_ids=[0, NUM_BLOCKS - 1]), layout, NUM_BLOCKS, None)
    with pytest.raises(BlockNotAllowedError, match=r"\[12, 40\] are outside the pool's 12"):
        wire.validate_header(good_header(dst_block_ids=[40, 12]), layout, NUM_BLOCKS, None)


def test_an_out_of_pool_block_is_named_as_such_even_when_also_unreserved() -> None:
    with pytest.raises(BlockNotAllowedError, match="outside the pool"):
        wire.validate_header(good_header(dst_block_ids=[4, 99]), f32_layout(), NUM_BLOCKS, {4})


# -- verify_payload ------------------------------------------------------------------------------


def header_for(payload: bytes) -> kv_transfer_pb2.KVTransferHeader:
    layout = f32_layout()
    num_blocks = len(payload) // layout.block_bytes
    return wire.make_header(
        "req-9", 1, layout, list(range(num_blocks)), len(payload), wire.crc32c(payload), 4
    )


def random_payload(num_blocks: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(f32_layout().payload_bytes(num_blocks))


def test_verify_payload_accepts_the_payload_in_any_buffer_type() -> None:
    payload = random_payload(2)
    header = header_for(payload)
    arr = np.frombuffer(payload, dtype=np.uint8)
    for buf in (
        payload,
        bytearray(payload),
        memoryview(payload),
        arr,
        arr.view(np.float32),
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).numpy(),
    ):
        wire.verify_payload(header, buf)


@pytest.mark.parametrize("delta", [-1, 1, -1536])
def test_verify_payload_refuses_a_payload_of_another_size(delta: int) -> None:
    payload = random_payload(2)
    header = header_for(payload)
    wrong = payload[:delta] if delta < 0 else payload + b"\0" * delta
    message = f"req-9: payload is {len(wrong)} bytes, header declares 3072"
    with pytest.raises(PayloadSizeError, match=message):
        wire.verify_payload(header, wrong)


def test_verify_payload_refuses_a_flipped_byte_naming_both_checksums() -> None:
    payload = random_payload(2)
    header = header_for(payload)
    corrupted = bytearray(payload)
    corrupted[len(corrupted) // 3] ^= 0x40
    actual = wire.crc32c(corrupted)
    with pytest.raises(ChecksumError) as info:
        wire.verify_payload(header, corrupted)
    message = str(info.value)
    assert "req-9: checksum mismatch" in message
    assert f"payload CRC-32C {actual:#010x}" in message
    assert f"header {header.crc32c:#010x}" in message
    assert info.value.status == "INVALID_ARGUMENT"


def test_verify_payload_refuses_a_wrong_checksum_in_the_header() -> None:
    payload = random_payload(1)
    header = header_for(payload)
    header.crc32c ^= 1
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        wire.verify_payload(header, payload)


def test_every_single_bit_flip_of_a_block_is_caught() -> None:
    payload = random_payload(1, seed=3)  # 1536 bytes: 12288 single-bit errors
    header = header_for(payload)
    corrupted = bytearray(payload)
    for i in range(len(payload)):
        for bit in range(8):
            corrupted[i] ^= 1 << bit
            assert wire.crc32c(corrupted) != header.crc32c, (i, bit)
            corrupted[i] ^= 1 << bit
    wire.verify_payload(header, corrupted)  # restored
