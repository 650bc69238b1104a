"""The registry's prefix index held in the gateway's memory (kept in step by prefix_follower.py),
and the routing lookup over it: `Registry.prefix_match_tiers`'s answer without a Redis round
trip, hashing the prompt only as far as some worker can still use it.

Each block hash maps to a bit mask of the index ids that hold it: worker slot k's GPU is bit
2k, its host tier (`<worker>@host`) bit 2k + 1. The walk keeps two masks of slots, those whose
GPU run still goes on and those whose reusable run (that GPU run, then the host tier's from
where it ended) still goes on, and stops when the second is empty.

Memory: one dict entry per resident block and one set entry per (block, index id): about 150
to 190 bytes per block held by one id, up to about 150 more per further holder (measured by
tests/e2e/test_prefix_view.py).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping
from itertools import repeat

from splitserve.gateway.prompt_chain import SEGMENT, PromptChain
from splitserve.kv_transfer.registry_prefix import host_tier_id, index_owner


class PrefixView:
    """Which index ids hold which blocks; `lock` guards every call (the follower's thread
    writes, the gateway's routing threads read)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._held: dict[bytes, int] = {}  # block hash -> bits of the index ids holding it
        self._peak = 0  # the most blocks `_held` had since it was last compacted
        self._blocks: dict[str, set[bytes]] = {}  # index id -> the hashes it holds
        self._slots: dict[str, int] = {}  # worker (owner) id -> its slot
        self._owners: list[str | None] = []  # slot -> its owner (None: free)
        self._live: frozenset[str] | None = None  # None: every id counts
        self._live_gpu = 0  # bit 2k of every live owner's slot k

    # -- changes (under `lock`) ----------------------------------------------------------

    def load(self, snapshot: Mapping[str, Iterable[bytes]]) -> None:
        """Replace everything with `snapshot` (index id -> its hashes)."""
        self._held = {}
        self._peak = 0
        self._blocks.clear()
        self._slots.clear()
        self._owners.clear()
        self._live_gpu = 0
        for index_id, hashes in snapshot.items():
            self.add(index_id, hashes)
        self.set_live(self._live)

    def add(self, index_id: str, hashes: Iterable[bytes]) -> None:
        bit = self._bit(index_id)
        held = self._held
        blocks = self._blocks.setdefault(index_id, set())
        for h in hashes:
            held[h] = held.get(h, 0) | bit
            blocks.add(h)
        self._peak = max(self._peak, len(held))

    def remove(self, index_id: str, hashes: Iterable[bytes]) -> None:
        blocks = self._blocks.get(index_id)
        if not blocks:
            return
        self._drop(index_id, [h for h in hashes if h in blocks])

    def clear(self, worker_id: str) -> None:
        """Drop a worker's entries, its host tier's too."""
        for index_id in (worker_id, host_tier_id(worker_id)):
            self._drop(index_id, list(self._blocks.get(index_id, ())))

    def set_live(self, live: Collection[str] | None) -> None:
        """Count only these workers' entries (None: everyone's)."""
        self._live = None if live is None else frozenset(live)
        self._live_gpu = 0
        for slot, owner in enumerate(self._owners):
            if owner is not None and (self._live is None or owner in self._live):
                self._live_gpu |= 1 << (2 * slot)

    def _drop(self, index_id: str, hashes: list[bytes]) -> None:
        owner = index_owner(index_id)
        slot = self._slots.get(owner)
        if slot is None:
            return
        keep = ~(1 << (2 * slot + (index_id != owner)))
        held, blocks = self._held, self._blocks.get(index_id, set())
        for h in hashes:
            mask = held.get(h, 0) & keep
            if mask:
                held[h] = mask
            else:
                held.pop(h, None)
            blocks.discard(h)
        if not blocks:
            self._blocks.pop(index_id, None)
        elif len(hashes) > len(blocks):
            # NOTE: a set (and a dict) keeps its table when it empties: copied, it gives the
            # memory back (amortized over what was dropped)
            self._blocks[index_id] = set(blocks)
        if len(held) < self._peak // 4:
            self._held = dict(held)
            self._peak = len(held)
        if owner not in self._blocks and host_tier_id(owner) not in self._blocks:
            # NOTE: no bit of this slot is left in any mask: free for the next worker
            del self._slots[owner]
            self._owners[slot] = None
            self._live_gpu &= ~(1 << (2 * slot))

    def _bit(self, index_id: str) -> int:
        owner = index_owner(index_id)
        slot = self._slots.get(owner)
        if slot is None:
            if None in self._owners:
                slot = self._owners.index(None)
                self._owners[slot] = owner
            else:
                slot = len(self._owners)
                self._owners.append(owner)
            self._slots[owner] = slot
            if self._live is None or owner in self._live:
                self._live_gpu |= 1 << (2 * slot)
        return 1 << (2 * slot + (index_id != owner))

    # -- reads (under `lock`) --------------------------------------------------------------

    def entries(self) -> dict[str, int]:
        """How many blocks each index id holds."""
        return {index_id: len(hashes) for index_id, hashes in self._blocks.items()}

    def match(self, chain: PromptChain) -> dict[str, tuple[int, int]]:
        """`Registry.prefix_match_tiers(chain's hashes)`, for live workers only: per worker,
        (its leading GPU run, that run then its host tier's); those holding the first block
        in neither tier left out. Hashes only as far as some run still goes on."""
        n = chain.num_blocks
        if n == 0:
            return {}
        hashes = chain.hashes
        if not hashes:
            chain.extend()
        live = self._live_gpu
        first = self._held.get(hashes[0], 0)
        gpu = first & live  # slots whose GPU run goes on (at their GPU bit)
        run = gpu | ((first >> 1) & live)  # slots whose reusable run goes on
        # bit -> [GPU run, reusable run]; a run still going at the last block is `n` long
        ends: dict[int, list[int]] = {}
        for bit in _bits(run):
            ends[bit] = [0 if not gpu & bit else n, n]
        get = self._held.get
        pos = 1
        while run and pos < n:
            if pos == len(hashes):
                chain.extend()
            # NOTE: up to a segment of the blocks hashed so far at once, their holders read in
            # C: where each keeps every run going (a long hit's common case) they pass without
            # a turn each
            masks = list(map(get, hashes[pos : pos + SEGMENT], repeat(0)))
            if all(m & gpu == gpu and run & (gpu | (m >> 1)) == run for m in set(masks)):
                pos += len(masks)
                continue
            for mask in masks:
                now_gpu = gpu & mask
                now_run = run & (now_gpu | (mask >> 1))
                if now_gpu != gpu:
                    for bit in _bits(gpu & ~now_gpu):
                        ends[bit][0] = pos
                if now_run != run:
                    for bit in _bits(run & ~now_run):
                        ends[bit][1] = pos
                gpu, run = now_gpu, now_run
                pos += 1
                if not run:
                    break
        owners = self._owners
        return {str(owners[bit.bit_length() // 2]): (g, r) for bit, (g, r) in ends.items()}


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low)
        mask ^= low
    return out
