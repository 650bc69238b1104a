"""The KV-transfer wire format: raw cache bytes in one fixed order, described by a header.

A payload holds, for each layer in [layer_start, layer_end), the keys and then the values of
the pushed blocks, in the order of `dst_block_ids`:

    payload = [layer_start: K[b0 b1 .. bn-1] V[b0 .. bn-1]] [layer_start+1: K[..] V[..]] ...
    one K or V block = [block_size, num_kv_heads, head_dim] elements, little-endian

so it is exactly the tensor [layers, 2, n, block_size, num_kv_heads, head_dim] in C order. No
pickle, no numpy dtypes: element bytes travel as they sit in memory (bf16 through a uint8 view).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import grpc
import torch

from splitserve.engine.errors import InvalidRequest, SplitserveError
from splitserve.kv_transfer.crc32c import crc32c
from splitserve.protos.v1 import kv_transfer_pb2

LAYOUT = "layer,kv,block,slot,head,dim"
MAX_CHUNK_BYTES = 1 << 20
"""Largest `data` message of a PushBlocks stream (the proto's contract)."""

Buffer = bytes | bytearray | memoryview

DTYPES = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)
_DTYPE_NAMES = MappingProxyType({v: k for k, v in DTYPES.items()})


class KVTransferError(InvalidRequest):
    """A header or payload that the receiver must refuse (INVALID_ARGUMENT)."""


class LayoutMismatchError(KVTransferError):
    """Layout string, dtype or block geometry differs from the receiver's cache."""


class LayerRangeError(KVTransferError):
    """[layer_start, layer_end) is empty or outside the cache."""


class BlockNotAllowedError(KVTransferError):
    """A destination block is outside the request's reservation (or the cache), or repeated."""


class PayloadSizeError(KVTransferError):
    """The payload's size differs from what the header declares or implies."""


class ChecksumError(KVTransferError):
    """The payload's CRC-32C differs from the header's."""


class PushRefused(SplitserveError):
    """The receiver refuses a push for a reason that is not the sender's bad input.

    `code` is the status the receiver answers with: FAILED_PRECONDITION for a stale fencing
    token, NOT_FOUND for a request it holds no reservation for.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.status = code.name


@dataclass(frozen=True)
class CacheLayout:
    """Shape and element type of a paged KV cache, as far as the wire format cares."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported KV dtype {self.dtype}; supported: {list(DTYPES)}")

    @classmethod
    def from_kv_caches(cls, kv_caches: Sequence[torch.Tensor]) -> CacheLayout:
        """The layout of per-layer [2, num_blocks, block_size, num_kv_heads, head_dim] tensors."""
        if not kv_caches:
            raise ValueError("no KV cache layers")
        first = kv_caches[0]
        for i, cache in enumerate(kv_caches):
            if cache.dim() != 5 or cache.shape[0] != 2:
                raise ValueError(
                    f"layer {i}: expected [2, blocks, slots, heads, dim], got {tuple(cache.shape)}"
                )
            if cache.shape != first.shape or cache.dtype != first.dtype:
                raise ValueError(f"layer {i} differs from layer 0 in shape or dtype")
        _, _, block_size, num_kv_heads, head_dim = first.shape
        return cls(len(kv_caches), block_size, num_kv_heads, head_dim, first.dtype)

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of the keys (or values) of one block in one layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * elem

    def payload_bytes(self, num_blocks: int, num_layers: int) -> int:
        """Size of a payload of `num_blocks` blocks over `num_layers` layers."""
        return num_layers * 2 * num_blocks * self.block_bytes


def pack_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    layer_start: int = 0,
    layer_end: int | None = None,
) -> bytes:
    """Gather `block_ids` of layers [layer_start, layer_end) into one payload (see module doc)."""
    layout = CacheLayout.from_kv_caches(kv_caches)
    layer_end = layout.num_layers if layer_end is None else layer_end
    if not 0 <= layer_start < layer_end <= layout.num_layers:
        raise LayerRangeError(
            f"bad layer range [{layer_start}, {layer_end}) of {layout.num_layers} layers"
        )
    num_blocks = kv_caches[0].shape[1]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise BlockNotAllowedError(f"block ids {bad} outside the cache's {num_blocks} blocks")
    device = kv_caches[0].device
    index = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    shape = (layer_end - layer_start, 2, len(block_ids), *kv_caches[0].shape[2:])
    out = torch.empty(shape, dtype=layout.dtype, device=device)
    for i, layer in enumerate(range(layer_start, layer_end)):
        torch.index_select(kv_caches[layer], 1, index, out=out[i])
    return out.cpu().view(torch.uint8).numpy().tobytes()


def make_header(
    request_id: str,
    fence: int,
    layout: CacheLayout,
    dst_block_ids: Sequence[int],
    payload: Buffer,
    layer_start: int,
    layer_end: int,
    num_tokens_after: int,
) -> kv_transfer_pb2.KVTransferHeader:
    """Describe `payload` (from `pack_blocks`) for the receiver, checksum included."""
    expected = layout.payload_bytes(len(dst_block_ids), layer_end - layer_start)
    if len(payload) != expected:
        raise PayloadSizeError(
            f"payload is {len(payload)} bytes; {len(dst_block_ids)} blocks "
            f"over layers [{layer_start}, {layer_end}) are {expected}"
        )
    return kv_transfer_pb2.KVTransferHeader(
        request_id=request_id,
        fence=fence,
        layout=LAYOUT,
        dtype=layout.dtype_name,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layer_start=layer_start,
        layer_end=layer_end,
        dst_block_ids=list(dst_block_ids),
        payload_bytes=len(payload),
        crc32c=crc32c(payload),
        num_tokens_after=num_tokens_after,
    )


def validate_header(
    header: kv_transfer_pb2.KVTransferHeader,
    layout: CacheLayout,
    allowed_block_ids: Collection[int] | None,
) -> None:
    """Raise a `KVTransferError` unless a payload described by `header` fits `layout`.

    `allowed_block_ids` is the request's reservation; None allows any block id.
    """
    rid = header.request_id
    if header.layout != LAYOUT:
        raise LayoutMismatchError(
            f"{rid}: unknown payload layout {header.layout!r}; expected {LAYOUT!r}"
        )
    if header.dtype != layout.dtype_name:
        raise LayoutMismatchError(
            f"{rid}: dtype {header.dtype!r} does not match the receiver's {layout.dtype_name!r}"
        )
    for name in ("block_size", "num_kv_heads", "head_dim"):
        if getattr(header, name) != getattr(layout, name):
            raise LayoutMismatchError(
                f"{rid}: {name} {getattr(header, name)} does not match "
                f"the receiver's {getattr(layout, name)}"
            )
    if not header.layer_start < header.layer_end <= layout.num_layers:
        raise LayerRangeError(
            f"{rid}: bad layer range [{header.layer_start}, "
            f"{header.layer_end}) for {layout.num_layers} layers"
        )
    dst = list(header.dst_block_ids)
    if len(set(dst)) != len(dst):
        raise BlockNotAllowedError(f"{rid}: repeated destination blocks in {dst}")
    if allowed_block_ids is not None:
        outside = sorted(b for b in set(dst) if b not in allowed_block_ids)
        if outside:
            raise BlockNotAllowedError(
                f"{rid}: destination blocks {outside} are not reserved for this request"
            )
    expected = layout.payload_bytes(len(dst), header.layer_end - header.layer_start)
    if header.payload_bytes != expected:
        raise PayloadSizeError(
            f"{rid}: payload_bytes {header.payload_bytes} but {len(dst)} "
            f"blocks over layers [{header.layer_start}, {header.layer_end}) "
            f"are {expected} bytes"
        )


def _check_size(header: kv_transfer_pb2.KVTransferHeader, payload: Buffer) -> None:
    if len(payload) != header.payload_bytes:
        raise PayloadSizeError(
            f"{header.request_id}: payload is {len(payload)} bytes, header "
            f"declares {header.payload_bytes}"
        )


def verify_payload(header: kv_transfer_pb2.KVTransferHeader, payload: Buffer) -> None:
    """Raise unless `payload` has the header's size and CRC-32C."""
    _check_size(header, payload)
    actual = crc32c(payload)
    if actual != header.crc32c:
        raise ChecksumError(
            f"{header.request_id}: checksum mismatch: payload CRC-32C "
            f"{actual:#010x}, header {header.crc32c:#010x}"
        )


def unpack_into(
    kv_caches: Sequence[torch.Tensor],
    header: kv_transfer_pb2.KVTransferHeader,
    payload: Buffer,
    *,
    verify: bool = True,
) -> None:
    """Write the payload's blocks into `kv_caches` at `header.dst_block_ids`.

    Size, checksum (unless `verify=False`, for a payload already checked with
    `verify_payload`) and geometry are all checked before the first byte is written. A
    writable buffer (bytearray) is read in place; a read-only one is copied once.
    """
    if verify:
        verify_payload(header, payload)
    else:
        _check_size(header, payload)
    layout = CacheLayout.from_kv_caches(kv_caches)
    validate_header(header, layout, None)
    num_blocks = kv_caches[0].shape[1]
    outside = [b for b in header.dst_block_ids if b >= num_blocks]
    if outside:
        raise BlockNotAllowedError(
            f"{header.request_id}: destination blocks {outside} are "
            f"outside the cache's {num_blocks} blocks"
        )
    if not header.dst_block_ids:
        return
    view = memoryview(payload).cast("B")
    # NOTE: torch.frombuffer warns on read-only memory; a copy keeps the caller's bytes safe.
    buffer = bytearray(view) if view.readonly else view
    num_layers = header.layer_end - header.layer_start
    shape = (num_layers, 2, len(header.dst_block_ids), *kv_caches[0].shape[2:])
    src = torch.frombuffer(buffer, dtype=torch.uint8).view(layout.dtype).view(shape)
    device = kv_caches[0].device
    index = torch.tensor(list(header.dst_block_ids), dtype=torch.long, device=device)
    for i in range(num_layers):
        kv_caches[header.layer_start + i].index_copy_(1, index, src[i].to(device))


def split_payload(payload: Buffer, max_chunk: int = MAX_CHUNK_BYTES) -> Iterator[memoryview]:
    """Slices of at most `max_chunk` bytes, without copying; nothing for an empty payload."""
    if max_chunk < 1:
        raise ValueError(f"max_chunk must be positive, got {max_chunk}")
    view = memoryview(payload).cast("B")
    for start in range(0, len(view), max_chunk):
        yield view[start : start + max_chunk]
