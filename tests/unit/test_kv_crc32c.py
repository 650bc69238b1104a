"""The C CRC-32C that checks KV payloads on the wire (`kv_transfer/wire.py`): against known
vectors (the CRC catalogue, RFC 3720), a bitwise reference from the definition on odd sizes and a
table reference on large buffers, over every buffer type a sender or receiver hands it, and
continued over chunks as the receiver computes it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from splitserve.kv_transfer import wire


def bitwise_crc32c(data: bytes) -> int:
    """Bit-at-a-time reference straight from the definition (reflected 0x1EDC6F41)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def table_crc32c(data: bytes) -> int:
    """Byte-table CRC: fast enough for a megabyte; its table is built from `bitwise_crc32c`."""
    table = [bitwise_crc32c(bytes([b])) ^ bitwise_crc32c(b"\0") for b in range(256)]
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_crc32c_known_vectors() -> None:
    assert wire.crc32c(b"123456789") == 0xE3069283  # the CRC catalogue's check value
    assert wire.crc32c(b"") == 0
    # RFC 3720 (iSCSI) appendix B.4
    assert wire.crc32c(bytes(32)) == 0x8A9136AA
    assert wire.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert wire.crc32c(bytes(range(32))) == 0x46DD794E
    assert wire.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert bitwise_crc32c(b"123456789") == 0xE3069283  # the reference is the right CRC


@pytest.mark.parametrize("size", [1, 3, 7, 15, 17, 31, 63, 65, 127, 255, 257, 1023, 4099])
def test_crc32c_matches_the_bitwise_reference_on_random_data_of_odd_sizes(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert wire.crc32c(data) == bitwise_crc32c(data)


@pytest.mark.parametrize("size", [65536 + 7, (1 << 20) + 13])
def test_crc32c_matches_the_table_reference_on_large_buffers(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert wire.crc32c(data) == table_crc32c(data)


def test_crc32c_accepts_every_buffer_type_without_copying_errors() -> None:
    data = random.Random(5).randbytes(4096 + 3)
    expected = bitwise_crc32c(data)
    arr = np.frombuffer(data, dtype=np.uint8)
    backing = bytearray(b"xyz" + data + b"!")
    buffers = {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "memoryview of a slice": memoryview(backing)[3:-1],
        "read-only numpy": arr,
        "writable numpy": arr.copy(),
        "numpy slice": np.frombuffer(backing, dtype=np.uint8)[3:-1],
        "torch tensor's numpy": torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy(),
    }
    for name, buf in buffers.items():
        value = wire.crc32c(buf)
        assert type(value) is int, name
        assert value == expected, name


def test_crc32c_of_multibyte_elements_is_the_crc_of_their_bytes() -> None:
    data = random.Random(6).randbytes(4 * 1000)
    expected = bitwise_crc32c(data)
    assert wire.crc32c(np.frombuffer(data, dtype=np.float32)) == expected
    assert wire.crc32c(np.frombuffer(data, dtype=np.uint16).reshape(40, 50)) == expected
    assert wire.crc32c(memoryview(data).cast("I")) == expected
    bf16 = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
    assert wire.crc32c(bf16.view(torch.uint8).numpy()) == expected


def test_crc32c_continues_over_chunks_as_the_receiver_computes_it() -> None:
    data = bytes(random.Random(5).randbytes(10_000))
    whole = wire.crc32c(data)
    running = 0
    for start in range(0, len(data), 777):
        running = wire.crc32c(memoryview(data)[start : start + 777], running)
    assert running == whole
