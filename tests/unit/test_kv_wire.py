"""The KV wire format: pack/unpack round trips, header validation, CRC-32C."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.kv_transfer import wire
from splitserve.kv_transfer.wire import (
    LAYOUT,
    BlockNotAllowedError,
    CacheLayout,
    ChecksumError,
    KVTransferError,
    LayerRangeError,
    LayoutMismatchError,
    PayloadSizeError,
)
from splitserve.protos.v1 import kv_transfer_pb2

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 12, 4, 2, 8


def make_caches(dtype: torch.dtype, fill: str = "random") -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if fill == "zeros":
        return [torch.zeros(shape, dtype=dtype) for _ in range(NUM_LAYERS)]
    return [torch.randn(shape).to(dtype) for _ in range(NUM_LAYERS)]


def slow_crc32c(data: bytes) -> int:
    """Bit-at-a-time reference straight from the definition (reflected 0x1EDC6F41)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def assert_blocks_equal(
    dst: list[torch.Tensor], src: list[torch.Tensor], pairs: list[tuple[int, int]], layers: range
) -> None:
    for layer in layers:
        for d, s in pairs:
            # Bitwise comparison: equal as bytes, so NaN-free and signed zeros both count.
            got = dst[layer][:, d].contiguous().view(torch.uint8)
            want = src[layer][:, s].contiguous().view(torch.uint8)
            assert torch.equal(got, want), (layer, d, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_roundtrip_is_bit_exact_for_non_contiguous_blocks(dtype: torch.dtype) -> None:
    src, dst = make_caches(dtype), make_caches(dtype, "zeros")
    src_ids, dst_ids = [9, 2, 7, 3], [0, 11, 5, 6]
    layout = CacheLayout.from_kv_caches(src)
    payload = wire.pack_blocks(src, src_ids)
    assert len(payload) == layout.payload_bytes(4, NUM_LAYERS)
    header = wire.make_header("req", 1, layout, dst_ids, payload, 0, NUM_LAYERS, 13)
    wire.unpack_into(dst, header, payload)
    assert_blocks_equal(dst, src, list(zip(dst_ids, src_ids, strict=True)), range(NUM_LAYERS))
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert all(not c[:, untouched].any() for c in dst)


def test_payload_is_layer_kv_block_ordered() -> None:
    src = make_caches(torch.float32)
    payload = wire.pack_blocks(src, [4, 1])
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    expected = torch.stack([torch.stack([c[0, [4, 1]], c[1, [4, 1]]]) for c in src])
    assert torch.equal(flat, expected.reshape(-1))


def test_layer_range_lands_only_in_those_layers() -> None:
    src, dst = make_caches(torch.bfloat16), make_caches(torch.bfloat16, "zeros")
    layout = CacheLayout.from_kv_caches(src)
    payload = wire.pack_blocks(src, [5, 8], layer_start=1, layer_end=3)
    assert len(payload) == layout.payload_bytes(2, 2)
    header = wire.make_header("req", 1, layout, [2, 3], payload, 1, 3, 8)
    wire.unpack_into(dst, header, payload)
    assert_blocks_equal(dst, src, [(2, 5), (3, 8)], range(1, 3))
    assert not dst[0].any()


def test_empty_block_list_is_an_empty_payload() -> None:
    src, dst = make_caches(torch.float16), make_caches(torch.float16, "zeros")
    payload = wire.pack_blocks(src, [])
    assert payload == b""
    header = wire.make_header("req", 1, CacheLayout.from_kv_caches(src), [], payload, 0, 3, 0)
    wire.unpack_into(dst, header, payload)
    assert all(not c.any() for c in dst)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"block_ids": [NUM_BLOCKS]}, BlockNotAllowedError),
        ({"layer_start": 2, "layer_end": 2}, LayerRangeError),
        ({"layer_end": NUM_LAYERS + 1}, LayerRangeError),
    ],
)
def test_pack_refuses_bad_blocks_and_layers(kwargs: dict, error: type[Exception]) -> None:
    args = {"block_ids": [0, 1], **kwargs}
    with pytest.raises(error):
        wire.pack_blocks(make_caches(torch.float32), **args)


def good_header(**overrides: object) -> kv_transfer_pb2.KVTransferHeader:
    layout = CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    payload = bytes(layout.payload_bytes(2, NUM_LAYERS))
    header = wire.make_header("req-7", 3, layout, [4, 5], payload, 0, NUM_LAYERS, 8)
    for field, value in overrides.items():
        if field == "dst_block_ids":
            del header.dst_block_ids[:]
            header.dst_block_ids.extend(value)  # type: ignore[arg-type]
        else:
            setattr(header, field, value)
    return header


BAD_HEADERS = [
    ({"layout": "block,layer,kv"}, LayoutMismatchError, "unknown payload layout"),
    ({"dtype": "bfloat16"}, LayoutMismatchError, "dtype 'bfloat16'"),
    ({"dtype": "int8"}, LayoutMismatchError, "dtype 'int8'"),
    ({"block_size": 16}, LayoutMismatchError, "block_size 16"),
    ({"num_kv_heads": 4}, LayoutMismatchError, "num_kv_heads 4"),
    ({"head_dim": 64}, LayoutMismatchError, "head_dim 64"),
    ({"layer_start": 2, "layer_end": 2}, LayerRangeError, "bad layer range [2, 2)"),
    ({"layer_start": 3, "layer_end": 1}, LayerRangeError, "bad layer range"),
    ({"layer_end": NUM_LAYERS + 1}, LayerRangeError, "for 3 layers"),
    ({"dst_block_ids": [4, 9]}, BlockNotAllowedError, "[9] are not reserved"),
    ({"dst_block_ids": [4, 4]}, BlockNotAllowedError, "repeated"),
    ({"payload_bytes": 1}, PayloadSizeError, "payload_bytes 1"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), BAD_HEADERS)
def test_validate_header_refuses_with_a_clear_message(
    overrides: dict, error: type[KVTransferError], message: str
) -> None:
    layout = CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    with pytest.raises(error, match=message.replace("[", r"\[").replace(")", r"\)")) as info:
        wire.validate_header(good_header(**overrides), layout, allowed_block_ids={4, 5, 6})
    assert isinstance(info.value, ValueError)
    assert "req-7" in str(info.value)


def test_validate_header_accepts_a_good_header_and_any_blocks_when_unrestricted() -> None:
    layout = CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    wire.validate_header(good_header(), layout, allowed_block_ids=[4, 5])
    wire.validate_header(good_header(), layout, allowed_block_ids=None)


def test_make_header_refuses_a_payload_of_the_wrong_size() -> None:
    layout = CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    with pytest.raises(PayloadSizeError):
        wire.make_header("r", 1, layout, [1, 2], b"\0" * 10, 0, NUM_LAYERS, 8)


def test_corrupted_payload_raises_checksum_error_and_leaves_caches_untouched() -> None:
    src, dst = make_caches(torch.bfloat16), make_caches(torch.bfloat16)
    before = [c.clone() for c in dst]
    layout = CacheLayout.from_kv_caches(src)
    payload = bytearray(wire.pack_blocks(src, [1, 2, 3]))
    header = wire.make_header("req", 1, layout, [4, 5, 6], payload, 0, NUM_LAYERS, 12)
    payload[len(payload) // 2] ^= 0x01
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        wire.unpack_into(dst, header, payload)
    with pytest.raises(PayloadSizeError):
        wire.unpack_into(dst, header, payload[:-1])
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


def test_unpack_refuses_blocks_outside_the_cache_and_a_foreign_geometry() -> None:
    src = make_caches(torch.float32)
    layout = CacheLayout.from_kv_caches(src)
    payload = wire.pack_blocks(src, [0])
    header = wire.make_header("req", 1, layout, [NUM_BLOCKS], payload, 0, NUM_LAYERS, 4)
    with pytest.raises(BlockNotAllowedError, match="outside the cache"):
        wire.unpack_into(make_caches(torch.float32), header, payload)
    with pytest.raises(LayoutMismatchError):
        wire.unpack_into(make_caches(torch.float16), header, payload)


def test_crc32c_known_vectors() -> None:
    assert wire.crc32c(b"123456789") == 0xE3069283
    assert wire.crc32c(b"") == 0
    assert wire.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4
    assert wire.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert wire.crc32c(bytes(range(32))) == 0x46DD794E


def table_crc32c(data: bytes) -> int:
    """Byte-table CRC (no lanes): fast enough for megabytes, pinned to `slow_crc32c` below."""
    table = [slow_crc32c(bytes([b])) ^ slow_crc32c(b"\0") for b in range(256)]
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@pytest.mark.parametrize("size", [1, 3, 15, 16, 63, 64, 65, 255, 256, 1024, 4099])
def test_crc32c_matches_the_bitwise_reference_on_random_data(size: int) -> None:
    data = random.Random(size).randbytes(size)
    expected = slow_crc32c(data)
    assert wire.crc32c(data) == expected == table_crc32c(data)
    assert wire.crc32c(memoryview(bytearray(data))) == expected


@pytest.mark.parametrize("size", [65536 + 7, 1 << 18, (1 << 20) + 13, (4 << 20) + 5])
def test_crc32c_matches_the_table_reference_on_large_buffers(size: int) -> None:
    # Large sizes take the widest lanes and every recursion level, with odd tails.
    data = random.Random(size).randbytes(size)
    assert wire.crc32c(data) == table_crc32c(data)


def test_split_payload_covers_the_payload_in_bounded_chunks() -> None:
    payload = bytes(range(256)) * 41
    chunks = list(wire.split_payload(payload, max_chunk=1000))
    assert [len(c) for c in chunks] == [1000] * 10 + [496]
    assert b"".join(chunks) == payload
    assert list(wire.split_payload(b"")) == []
    with pytest.raises(ValueError):
        list(wire.split_payload(payload, max_chunk=0))


def test_cache_layout_from_kv_caches_and_its_checks() -> None:
    layout = CacheLayout.from_kv_caches(make_caches(torch.bfloat16))
    assert layout == CacheLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    assert layout.dtype_name == "bfloat16"
    assert layout.block_bytes == BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
    assert LAYOUT == "layer,kv,block,slot,head,dim"
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        CacheLayout(1, 1, 1, 1, torch.int8)
    with pytest.raises(ValueError, match="differs"):
        CacheLayout.from_kv_caches([torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 5, 4, 2, 8)])
