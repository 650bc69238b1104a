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

With sliding layers kept apart (engine/window_slots.py), a block carries the full layers only
(`layer_end` counts them) and the window slots of `dst_window_slots` follow the blocks, each
the `window_layers` sliding layers' pages:

    payload = [block 0: full layers] … [block n-1] [slot 0: sliding layers] … [slot m-1]

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
    window_layers: int = 0  # sliding layers in a window slot (0: no window pool)

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
        window = region.window.num_layers if region.window is not None else 0
        return cls(
            region.num_layers, region.block_size, region.num_kv_heads, region.head_dim,
            region.dtype, region.num_planes, window,
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

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return (self.window_layers, *self.block_shape[1:])

    @property
    def slot_bytes(self) -> int:
        """Bytes of one window slot: every sliding layer's page."""
        return self.block_bytes // self.num_layers * self.window_layers

    def payload_bytes(self, num_blocks: int, num_slots: int = 0) -> int:
        return num_blocks * self.block_bytes + num_slots * self.slot_bytes


def make_header(
    request_id: str,
    fence: int,
    layout: CacheLayout,
    dst_block_ids: Collection[int],
    payload_bytes: int,
    checksum: int,
    num_tokens_after: int,
    capability: bytes = b"",
    dst_window_slots: Collection[int] = (),
) -> kv_transfer_pb2.KVTransferHeader:
    """Describe a payload of `dst_block_ids` blocks (and `dst_window_slots` slots after them)
    for the receiver."""
    expected = layout.payload_bytes(len(dst_block_ids), len(dst_window_slots))
    if payload_bytes != expected:
        raise PayloadSizeError(
            f"payload is {payload_bytes} bytes; {len(dst_block_ids)} blocks"
            f"{_and_slots(len(dst_window_slots))} are {expected}"
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
        dst_window_slots=list(dst_window_slots),
        window_layers=layout.window_layers,
    )


def validate_header(
    header: kv_transfer_pb2.KVTransferHeader,
    layout: CacheLayout,
    num_pool_blocks: int,
    allowed_block_ids: Collection[int] | None,
    num_pool_slots: int = 0,
) -> None:
    """Raise a `KVTransferError` unless a payload described by `header` fits this pool (and,
    when given, the request's reservation; its window slots are the Landing's to check)."""
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
    if header.window_layers != layout.window_layers:
        raise LayoutMismatchError(
            f"{rid}: {header.window_layers} sliding layers in a window pool, the receiver's "
            f"{layout.window_layers} (both ends keep sliding layers apart, or neither)"
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
    slots = list(header.dst_window_slots)
    if len(set(slots)) != len(slots) or len(slots) > len(dst):
        raise BlockNotAllowedError(f"{rid}: window slots {slots[:16]} repeated or too many")
    outside = sorted(s for s in set(slots) if not 0 < s < num_pool_slots)
    if outside:
        raise BlockNotAllowedError(
            f"{rid}: window slots {outside[:16]} are outside the pool's [1, {num_pool_slots})"
        )
    expected = layout.payload_bytes(len(dst), len(slots))
    if header.payload_bytes != expected:
        raise PayloadSizeError(
            f"{rid}: payload_bytes {header.payload_bytes} but {len(dst)} blocks"
            f"{_and_slots(len(slots))} are {expected}"
        )


def _and_slots(num_slots: int) -> str:
    return f" and {num_slots} window slots" if num_slots else ""


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


def split_payload(
    payload: torch.Tensor, layout: CacheLayout, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 payload of `num_blocks` blocks and window slots after them, viewed as
    ([num_blocks, *block_shape], [num_slots, *slot_shape]) of the layout's dtype."""
    cut = num_blocks * layout.block_bytes
    blocks = as_blocks(payload[:cut], layout)
    slots = payload[cut:].view(layout.dtype).view(-1, *layout.slot_shape)
    return blocks, slots
