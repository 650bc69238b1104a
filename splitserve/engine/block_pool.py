"""The pool of physical KV blocks: reference counts, the free list and the prefix cache.

Every block is in exactly one state at any moment:

    free     ref_count == 0, no hash      (in `_free`, handed out first)
    cached   ref_count == 0, hashed       (in `_evictable`, LRU order: reused by a prefix hit,
                                           or evicted when no free block is left)
    in use   ref_count  > 0               (hashed once full and computed)

so `free + cached + in use == total` always holds; `check_integrity` proves it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


class BlockIntegrityError(RuntimeError):
    """The block pool's bookkeeping is inconsistent (a bug, never a user error)."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # The tokens a cached block holds, compared on a hit: a collision between blocks of
    # different content is caught; one between different prefixes of equal blocks is left to
    # the 128-bit chained hash.
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Physical blocks with reference counts and an LRU prefix cache of released blocks."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, record_events: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # (True, hash) when a block enters the prefix cache, (False, hash) when it leaves;
        # a decode worker mirrors them into the registry's prefix index.
        self.events: list[tuple[bool, bytes]] | None = [] if record_events else None
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks that an allocation may take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def drain_events(self) -> list[tuple[bool, bytes]]:
        """Prefix-cache insertions and evictions since the last call, in order."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens under this hash, if any."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def allocate(self) -> int:
        """Take a block for new tokens: a free one, else evict the least recently used cached."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(self.blocks[block_id])
            self.num_evictions += 1
        else:
            raise BlockIntegrityError("allocate() called with no block available")
        self.blocks[block_id].ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference (a prefix hit or a fork); a cached block leaves the LRU."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id)
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero a hashed block stays cached, an unhashed one is freed."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise BlockIntegrityError(f"block {block_id} released more often than taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def cache(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its hash, unless that content is cached already."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None or block_hash in self._by_hash:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._by_hash[block_hash] = block_id
        if self.events is not None:
            self.events.append((True, block_hash))

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None and self._by_hash.get(block.block_hash) == block.block_id:
            del self._by_hash[block.block_hash]
            if self.events is not None:
                self.events.append((False, block.block_hash))
        block.block_hash = None
        block.token_ids = ()

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """Raise BlockIntegrityError unless every block is in exactly one consistent state.

        `expected_refs` maps block id -> how many block tables hold it.
        """
        free, cached = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & cached:
            raise BlockIntegrityError("a block is listed twice among free and cached blocks")
        in_use = {b.block_id for b in self.blocks if b.ref_count > 0}
        if (in_use & free) or (in_use & cached):
            raise BlockIntegrityError("a block is both in use and free or cached")
        if len(free) + len(cached) + len(in_use) != self.num_blocks:
            raise BlockIntegrityError(
                f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} "
                f"!= total {self.num_blocks}"
            )
        for block in self.blocks:
            if block.ref_count != expected_refs.get(block.block_id, 0):
                raise BlockIntegrityError(
                    f"block {block.block_id} has ref_count {block.ref_count} but "
                    f"{expected_refs.get(block.block_id, 0)} block tables hold it"
                )
            if block.block_id in cached and block.block_hash is None:
                raise BlockIntegrityError(f"cached block {block.block_id} has no hash")
            if block.block_id in free and block.block_hash is not None:
                raise BlockIntegrityError(f"free block {block.block_id} still has a hash")
            indexed = self._by_hash.get(block.block_hash) if block.block_hash else None
            if block.block_hash is not None and indexed != block.block_id:
                raise BlockIntegrityError(f"hashed block {block.block_id} is not in the index")
        for block_hash, block_id in self._by_hash.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise BlockIntegrityError(f"hash index points at block {block_id} wrongly")
