"""The KV wire format of the gRPC transport: whole blocks as they sit in the pool, and a header.

A payload holds the pushed blocks in the order of `dst_block_ids`, each block every layer's page
(`kv_cache.kv_page`: planes, block_size, heads, dim) in turn. Keys then values (`LAYOUT`):

    payload = [block 0: layer 0 K V, layer 1 K V, …] [block 1: …] …
    = the tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in C order,
      element bytes as they sit in memory (bf16 travels as its raw 16 bits), little-endian.

DeepSeek's MLA latents (`LATENT_LAYOUT`): one plane of one row per token and layer, the header's
`num_kv_heads` 1 and `head_dim` kv_lora_rank + qk_rope_head_dim:

    payload = [block 0: layer 0 latents, layer 1 latents, …] [block 1: …] …
    = the tensor [num_blocks, num_layers, 1, block_size, 1, latent_dim] in C order.

The header's layout string names the planes, so a receiver whose pool holds the other kind
refuses the payload (as it refuses another dtype, block size, head count or width).

No pickle, no numpy dtypes on the wire. The checksum is CRC-32C from a C library (`crc32c`, with
the CPU's CRC instruction).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import crc32c as _crc32c
import torch

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.kv_connector import KVRegion
from splitserve.protos.v1 import kv_transfer_pb2

LAYOUT = "block,layer,kv,slot,head,dim"
LATENT_LAYOUT = "block,layer,latent,slot,head,dim"
LAYOUTS = MappingProxyType({2: LAYOUT, 1: LATENT_LAYOUT})
"""The layout string of a pool by its planes per layer: keys and values, or MLA latents."""
_WHAT = MappingProxyType({LAYOUT: "keys and values", LATENT_LAYOUT: "MLA latents"})
MAX_CHUNK_BYTES = 4 << 20
"""Largest `data` message of a PushBlocks stream (the proto's contract)."""

DTYPES = MappingProxyType(
    {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float8_e4m3fn": torch.float8_e4m3fn,  # an FP8 cache (scale 1): the blocks as stored
    }
)
_DTYPE_NAMES = MappingProxyType({v: k for k, v in DTYPES.items()})


class KVTransferError(InvalidRequest):
    """A header or payload that the receiver must refuse (INVALID_ARGUMENT)."""


class LayoutMismatchError(KVTransferError):
    """Layout string, dtype or block geometry differs from the receiver's cache."""


class BlockNotAllowedError(KVTransferError):
    """A destination block is outside the request's reservation (or the pool), or repeated."""


class PayloadSizeError(KVTransferError):
    """The payload's size differs from what the header declares or implies."""


class ChecksumError(KVTransferError):
    """The payload's CRC-32C differs from the header's."""


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of any buffer (bytes, bytearray, memoryview, numpy array);
    `value` continues an earlier result over the bytes that preceded `data`."""
    return int(_crc32c.crc32c(data, value))


@dataclass(frozen=True)
class CacheLayout:
    """Geometry and element type of a block-major pool, as far as the wire format cares."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_planes: int = 2  # keys and values; 1: MLA latents

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported KV dtype {self.dtype}; supported: {list(DTYPES)}")
        if self.num_planes not in LAYOUTS:
            raise ValueError(f"num_planes must be one of {sorted(LAYOUTS)}, got {self.num_planes}")

    @classmethod
    def of(cls, region: KVRegion) -> CacheLayout:
        return cls(
            region.num_layers, region.block_size, region.num_kv_heads, region.head_dim,
            region.dtype, region.num_planes,
        )  # fmt: skip

    @property
    def layout(self) -> str:
        """The header's layout string for this pool."""
        return LAYOUTS[self.num_planes]

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        page = (self.num_planes, self.block_size, self.num_kv_heads, self.head_dim)
        return (self.num_layers, *page)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every layer's page (keys and values, or latents)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        page = self.num_planes * self.block_size * self.num_kv_heads * self.head_dim
        return self.num_layers * page * elem

    def payload_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_bytes


def make_header(
    request_id: str,
    fence: int,
    layout: CacheLayout,
    dst_block_ids: Collection[int],
    payload_bytes: int,
    checksum: int,
    num_tokens_after: int,
    capability: bytes = b"",
) -> kv_transfer_pb2.KVTransferHeader:
    """Describe a payload of `dst_block_ids` blocks for the receiver."""
    expected = layout.payload_bytes(len(dst_block_ids))
    if payload_bytes != expected:
        raise PayloadSizeError(
            f"payload is {payload_bytes} bytes; {len(dst_block_ids)} blocks are {expected}"
        )
    return kv_transfer_pb2.KVTransferHeader(
        request_id=request_id,
        fence=fence,
        layout=layout.layout,
        dtype=layout.dtype_name,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layer_start=0,
        layer_end=layout.num_layers,
        dst_block_ids=list(dst_block_ids),
        capability=capability,
        payload_bytes=payload_bytes,
        crc32c=checksum,
        num_tokens_after=num_tokens_after,
    )


def validate_header(
    header: kv_transfer_pb2.KVTransferHeader,
    layout: CacheLayout,
    num_pool_blocks: int,
    allowed_block_ids: Collection[int] | None,
) -> None:
    """Raise a `KVTransferError` unless a payload described by `header` fits this pool (and,
    when given, the request's reservation)."""
    rid = header.request_id
    if header.layout not in _WHAT:
        raise LayoutMismatchError(
            f"{rid}: unknown payload layout {header.layout!r}; expected {layout.layout!r}"
        )
    if header.layout != layout.layout:
        raise LayoutMismatchError(
            f"{rid}: the payload holds {_WHAT[header.layout]} ({header.layout!r}) but the "
            f"receiver's pool holds {_WHAT[layout.layout]} ({layout.layout!r}): prefill and "
            "decode workers must serve the same model"
        )
    if header.dtype != layout.dtype_name:
        raise LayoutMismatchError(
            f"{rid}: dtype {header.dtype!r} does not match the receiver's {layout.dtype_name!r}"
        )
    for name in ("block_size", "num_kv_heads", "head_dim"):
        if getattr(header, name) != getattr(layout, name):
            latent = (
                " (the latent's width)" if name == "head_dim" and layout.num_planes == 1 else ""
            )
            raise LayoutMismatchError(
                f"{rid}: {name}{latent} {getattr(header, name)} does not match "
                f"the receiver's {getattr(layout, name)}"
            )
    if (header.layer_start, header.layer_end) != (0, layout.num_layers):
        raise LayoutMismatchError(
            f"{rid}: layers [{header.layer_start}, {header.layer_end}) but a block carries "
            f"all {layout.num_layers} layers"
        )
    dst = list(header.dst_block_ids)
    if len(set(dst)) != len(dst):
        raise BlockNotAllowedError(f"{rid}: repeated destination blocks in {dst[:16]}")
    outside = sorted(b for b in set(dst) if b >= num_pool_blocks)
    if outside:
        raise BlockNotAllowedError(
            f"{rid}: destination blocks {outside[:16]} are outside the pool's {num_pool_blocks}"
        )
    if allowed_block_ids is not None:
        outside = sorted(b for b in set(dst) if b not in allowed_block_ids)
        if outside:
            raise BlockNotAllowedError(
                f"{rid}: destination blocks {outside[:16]} are not reserved for this request"
            )
    expected = layout.payload_bytes(len(dst))
    if header.payload_bytes != expected:
        raise PayloadSizeError(
            f"{rid}: payload_bytes {header.payload_bytes} but {len(dst)} blocks are {expected}"
        )


def verify_payload(header: kv_transfer_pb2.KVTransferHeader, payload: Any) -> None:
    """Raise unless `payload` (any buffer) has the header's size and CRC-32C."""
    size = memoryview(payload).nbytes
    if size != header.payload_bytes:
        raise PayloadSizeError(
            f"{header.request_id}: payload is {size} bytes, header declares {header.payload_bytes}"
        )
    actual = crc32c(payload)
    if actual != header.crc32c:
        raise ChecksumError(
            f"{header.request_id}: checksum mismatch: payload CRC-32C "
            f"{actual:#010x}, header {header.crc32c:#010x}"
        )


def as_blocks(payload: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """A uint8 payload tensor viewed as [num_blocks, *block_shape] of the layout's dtype."""
    return payload.view(layout.dtype).view(-1, *layout.block_shape)
