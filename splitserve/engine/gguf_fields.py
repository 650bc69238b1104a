"""A GGUF file's metadata and tensor table, read fast; its tensor data as views of the file.

`gguf.GGUFReader` makes a numpy view for every element of every metadata array: for Gemma 3's
262,144-token vocabulary (tokens, scores, token types) that is millions of memmap slices, over
ten seconds on a CPU core before the first tensor is looked at. The layout is simple enough to
read directly: here `struct` walks a memory map of the file, numeric arrays come out of one
`np.frombuffer` each and string arrays out of one tight loop, in well under a second. Tensor
data is not read here: each tensor is a view into the map, laid out as `GGUFReader` lays it
out, and the `gguf` package still does all dequantization (`gguf_loader`).

The layout (GGUF v2 and v3, little-endian; v1 counted in 32 bits and is gone from the wild):

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count     x  key: string | value_type u32 | value
    tensor_count x  name: string | n_dims u32 | dims u64 x n_dims (innermost first)
                    | ggml_type u32 | offset u64 (from the data section's start)
    padding to `general.alignment` (u32, default 32) | the data section

    string: length u64 | UTF-8 bytes          array: element_type u32 | count u64 | elements

Only numpy is imported at module level (`gguf`'s type table is imported when a file is read):
the torch-free gateway reads GGUF files too.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.engine.gguf_archs import GGUFError

__all__ = ["ARRAY", "NUMERIC_TYPES", "STRING", "GGUFHeader", "TensorInfo", "read_gguf"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Metadata value types (gguf's `GGUFValueType`): the fixed-size ones by their struct code.
STRING, ARRAY = 8, 9
_SCALARS = {
    value_type: struct.Struct("<" + code)
    for value_type, code in {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                             10: "Q", 11: "q", 12: "d"}.items()
}  # fmt: skip
_U32, _U64 = _SCALARS[4], _SCALARS[10]
NUMERIC_TYPES = frozenset(_SCALARS)  # bool included
_MAX_NESTING = 8  # arrays of arrays (llama.cpp writes none): a corrupt file must not recurse on

# ggml tensor types that `GGUFReader` hands out as typed values (the rest: rows of raw bytes).
_PLAIN_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2",
                 "I32": "<i4", "I64": "<i8"}  # fmt: skip


class _Corrupt(Exception):
    """The file ends early or holds something no GGUF writer writes (the reason)."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table."""

    name: str
    dims: tuple[int, ...]  # as the file lists them: innermost first
    tensor_type: Any  # gguf.GGMLQuantizationType
    offset: int  # of its first byte, from the start of the file
    num_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's (and torch's) order: outermost first."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata, tensor table and data section (a read-only map of the file)."""

    path: Path
    version: int
    # key -> value: int, float, bool, str, or a list (of values, or of lists for arrays of
    # arrays; NOTE: `GGUFReader.contents()` flattens those)
    fields: dict[str, Any]
    # key -> (value type,) or, for an array, (ARRAY, element type)
    types: dict[str, tuple[int, ...]]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    _buffer: mmap.mmap

    def tensor_data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's data as `GGUFReader` gives it (a view of the file, nothing copied):
        float and integer types as their numpy type in numpy's axis order; block types (and
        BF16) as rows of bytes, the last axis counting bytes."""
        dtype = _PLAIN_DTYPES.get(tensor.tensor_type.name)
        if dtype is None:
            from gguf.quants import quant_shape_to_byte_shape

            shape = quant_shape_to_byte_shape(tensor.shape, tensor.tensor_type)
            count, dtype = tensor.num_bytes, "u1"
        else:
            shape, count = tensor.shape, tensor.num_bytes // np.dtype(dtype).itemsize
        data = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=tensor.offset)
        return data.reshape(shape)


def read_gguf(path: str | Path) -> GGUFHeader:
    """Parse `path`'s header and tensor table; GGUFError says why a file is not readable (not
    GGUF, an unsupported version, truncated, corrupt)."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # NOTE: ValueError: an empty file cannot be mapped
        raise GGUFError(f"{str(path)!r} is not a readable GGUF file: {exc}") from None
    try:
        return _parse(path, buffer)
    except (_Corrupt, struct.error, ValueError) as exc:  # NOTE: and UnicodeDecodeError
        reason = "it ends early" if isinstance(exc, struct.error) else str(exc)
        raise GGUFError(f"{str(path)!r} is not a readable GGUF file: {reason}") from None


def _parse(path: Path, buffer: mmap.mmap) -> GGUFHeader:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if buffer[:4] != MAGIC:
        raise _Corrupt(f"no GGUF magic (it starts {bytes(buffer[:4])!r})")
    (version,) = _U32.unpack_from(buffer, 4)
    if version & 0xFFFF == 0:
        raise _Corrupt("it is a big-endian GGUF file, which is not supported")
    if version not in VERSIONS:
        raise _Corrupt(f"GGUF version {version} is not supported (only 2 and 3)")
    tensor_count, kv_count = struct.unpack_from("<QQ", buffer, 8)
    reader = _Reader(buffer)
    reader.pos = 24
    fields: dict[str, Any] = {}
    types: dict[str, tuple[int, ...]] = {}
    for _ in range(kv_count):
        key = reader.string()
        if key in fields:
            raise _Corrupt(f"metadata key {key!r} appears twice")
        value_type = reader.u32()
        types[key] = (value_type,)
        if value_type == ARRAY:  # the element type, read again by `value`
            types[key] += (_U32.unpack_from(buffer, reader.pos)[0],)
        fields[key] = reader.value(value_type, 0)
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in fields and types["general.alignment"] != (4,):
        raise _Corrupt("general.alignment is not a u32")
    if alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment {alignment} is not a power of two")

    entries = []
    for _ in range(tensor_count):
        name = reader.string()
        n_dims = reader.u32()
        dims = struct.unpack_from(f"<{n_dims}Q", buffer, reader.pos)
        reader.pos += 8 * n_dims
        type_id, offset = struct.unpack_from("<IQ", buffer, reader.pos)
        reader.pos += 12
        entries.append((name, dims, type_id, offset))
    data_offset = -(-reader.pos // alignment) * alignment

    tensors, names = [], set()
    for name, dims, type_id, offset in entries:
        if name in names:
            raise _Corrupt(f"tensor {name!r} appears twice")
        names.add(name)
        if type_id not in GGML_QUANT_SIZES:
            raise _Corrupt(f"tensor {name!r} has unknown type id {type_id}")
        tensor_type = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if dims and dims[0] % block_size:
            raise _Corrupt(f"tensor {name!r}'s rows ({dims[0]}) are not whole {tensor_type.name} "
                           f"blocks of {block_size}")  # fmt: skip
        num_bytes = math.prod(dims) // block_size * type_size
        start = data_offset + offset
        if start + num_bytes > len(buffer):
            raise _Corrupt(f"tensor {name!r}'s data runs past the end of the file")
        tensors.append(TensorInfo(name, tuple(dims), tensor_type, start, num_bytes))
    return GGUFHeader(path, version, fields, types, tuple(tensors), alignment, data_offset, buffer)


class _Reader:
    """A cursor over the map: each read checks that the file holds what it reads."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.pos = 0

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buffer, self.pos)
        self.pos += 4
        return int(value)

    def string(self) -> str:
        (length,) = _U64.unpack_from(self.buffer, self.pos)
        start = self.pos + 8
        self.pos = start + length
        if self.pos > self.size:
            raise _Corrupt("a string runs past the end of the file")
        return str(self.buffer[start : self.pos], "utf-8")

    def value(self, value_type: int, depth: int) -> Any:
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            (value,) = scalar.unpack_from(self.buffer, self.pos)
            self.pos += scalar.size
            return value
        if value_type == STRING:
            return self.string()
        if value_type != ARRAY:
            raise _Corrupt(f"unknown metadata value type {value_type}")
        if depth >= _MAX_NESTING:
            raise _Corrupt(f"arrays nested deeper than {_MAX_NESTING}")
        element_type = self.u32()
        (count,) = _U64.unpack_from(self.buffer, self.pos)
        self.pos += 8
        scalar = _SCALARS.get(element_type)
        if scalar is not None:  # numeric: one read
            dtype = np.dtype(scalar.format)
            if self.pos + count * dtype.itemsize > self.size:
                raise _Corrupt("an array runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if count * 8 > self.size - self.pos:  # NOTE: every element takes 8 bytes or more
            raise _Corrupt("an array runs past the end of the file")
        if element_type == STRING:
            return self._strings(count)
        return [self.value(element_type, depth + 1) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """`count` strings: the loop a vocabulary of 262,144 tokens goes through."""
        buffer, unpack, pos = self.buffer, _U64.unpack_from, self.pos
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (length,) = unpack(buffer, pos)
            pos += 8
            append(str(buffer[pos : pos + length], "utf-8"))
            pos += length
        if pos > self.size:
            raise _Corrupt("a string runs past the end of the file")
        self.pos = pos
        return out
