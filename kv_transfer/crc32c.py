"""CRC-32C (Castagnoli) in numpy: slicing over many lanes, fast enough for KV payloads."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

Buffer = bytes | bytearray | memoryview


def _crc_byte_table() -> tuple[int, ...]:
    poly = 0x82F63B78  # Castagnoli, bit-reflected
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (poly if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc_byte_table()
# Lane counts tried from the widest; each level needs >= _CRC_MIN_STEPS words per lane.
_CRC_LANES = (65536, 16384, 4096, 1024, 256, 64, 16)
_CRC_MIN_STEPS = 4


def _gf2_apply(columns: Sequence[int], value: int) -> int:
    out, bit = 0, 0
    while value:
        if value & 1:
            out ^= columns[bit]
        value >>= 1
        bit += 1
    return out


@functools.cache
def _zero_shift(num_bytes: int) -> tuple[int, ...]:
    """Columns of the linear map "feed `num_bytes` zero bytes" on the CRC register."""
    if num_bytes == 1:
        return tuple(_CRC_TABLE[(1 << j) & 0xFF] ^ ((1 << j) >> 8) for j in range(32))
    half = _zero_shift(num_bytes // 2)
    square = tuple(_gf2_apply(half, c) for c in half)
    if num_bytes & 1:
        return tuple(_gf2_apply(_zero_shift(1), c) for c in square)
    return square


@functools.cache
def _zero_shift_tables(num_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The same map as two 65536-entry tables over the register's low and high halves."""
    columns = np.array(_zero_shift(num_bytes), dtype=np.uint32)
    tables = np.zeros((2, 1 << 16), dtype=np.uint32)
    for half in range(2):
        for j in range(16):
            tables[half, 1 << j : 2 << j] = tables[half, : 1 << j] ^ columns[16 * half + j]
    tables.setflags(write=False)
    return tables[0], tables[1]


def _crc_update(crc: int, data: memoryview) -> int:
    """Feed `data` into the raw (un-inverted) CRC register `crc`.

    NOTE: the register is linear in the data. The words are dealt round-robin to K lanes
    (row s of the [S, K] view is words s*K .. s*K+K-1); lane i folds its column with "shift by
    4K bytes", and the K lane registers, read as K little-endian words, are a message whose
    CRC is the CRC of the whole: recurse on it (4K bytes), then feed the leftover tail.
    """
    n = len(data)
    lanes = next((k for k in _CRC_LANES if n >= 4 * k * _CRC_MIN_STEPS), None)
    if lanes is None:
        for byte in data:
            crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
        return crc
    steps = n // (4 * lanes)
    words = np.frombuffer(data, dtype="<u4", count=steps * lanes).reshape(steps, lanes)
    low, high = _zero_shift_tables(4 * lanes)
    reg = words[0].astype(np.uint32)
    reg[0] ^= crc  # an initial register is the same as XOR-ing it into the first word
    low_half = np.empty(lanes, dtype=np.uint32)
    for s in range(1, steps):
        np.bitwise_and(reg, 0xFFFF, out=low_half)
        np.right_shift(reg, 16, out=reg)
        reg = low[low_half] ^ high[reg]
        reg ^= words[s]
    crc = _crc_update(0, memoryview(reg.astype("<u4").tobytes()))
    return _crc_update(crc, data[steps * lanes * 4 :])


def crc32c(data: Buffer) -> int:
    """CRC-32C (Castagnoli) of `data`, as iSCSI and `google-crc32c` compute it."""
    view = memoryview(data).cast("B")
    return _crc_update(0xFFFFFFFF, view) ^ 0xFFFFFFFF
