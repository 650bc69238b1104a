"""The host-memory tier's bookkeeping: which chained block hash sits in which host slot.

Blocks leave the GPU's prefix cache when it needs room; with a host tier they were copied out
when they were first hashed (write-through, off the step's path: `host_tier.py`), so a later
prompt with the same prefix finds them here and copies them back instead of recomputing:

    GPU prefix cache  b7 b2 b9 │ evicted ...            host slots  h3 h0 h5 h1 ...
    lookup: hashes    H0 H1 H2 │ H3 H4 ...  ──miss──▶   H3 -> h5, H4 -> h1  ──load──▶ new blocks

The same chained hashes key both tiers, so they agree on what a prefix is. Eviction is LRU
over the host slots, never of a slot a lookup found since the last `drain` (its load, issued
with this step's copies, still has to read it).
Pure bookkeeping, no torch: the block manager asks, `host_tier.HostTier` copies.

With `record_events()` it also records which chained hashes it gained and lost, as the GPU
pool does, so the worker can publish its host tier into the registry's prefix index too (the
gateway's router counts a host block as worth a little less than a GPU block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.engine.prefix_hash import chain_hash


@dataclass(frozen=True)
class HostWork:
    """Copies between the GPU pool and the host tier before the next step runs: `saves` (block,
    host slot) of newly hashed (or swapped-out) blocks, `loads` (host slot, block) of host
    hits; `reused`: a block whose save may still be in flight now takes new tokens. Saves go
    first (a block saved may be loaded into next), and the step waits for them when it loads
    or reuses a block."""

    saves: tuple[tuple[int, int], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()
    reused: bool = False


def contiguous_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source, first destination, length) of each run of (source, destination) pairs
    in which both step up by one: a run is one copy of consecutive blocks."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            first_src, first_dst, length = runs[-1]
            runs[-1] = (first_src, first_dst, length + 1)
        else:
            runs.append((src, dst, 1))
    return runs


# The tiers a prefix event names (`take_prefix_events`): the GPU pool's, this one's.
GPU_TIER = "gpu"
HOST_TIER = "host"

# NOTE: a partial key is this tag and a chained hash, so it can never equal a full block's
# (16-byte) chained hash, and `place` can tell it apart without being told: a partly filled
# block is no prefix another prompt can match, and is never published.
_PARTIAL_TAG = b"partial\0"


def partial_key(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key of a swapped-out, partly filled block (`BlockManager.swap_out`): apart from
    full blocks' chained hashes."""
    return _PARTIAL_TAG + chain_hash(b"partial" + (parent or b""), token_ids)


def is_partial_key(key: bytes) -> bool:
    """Whether `key` is a `partial_key` (not a full block's chained hash)."""
    return key.startswith(_PARTIAL_TAG) and len(key) > len(_PARTIAL_TAG)


class HostIndex:
    """An LRU map from block hash to host slot, with the tokens each slot holds, and the
    copies it owes the pool before the next step (`drain`)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("the host KV tier needs room for at least one block")
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_hits = 0  # blocks found here by prefix lookups
        self.num_evictions = 0
        self._found: set[int] = set()  # slots looked up since the last drain: kept
        self._saves: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._saving: set[int] = set()  # blocks whose save may still be in flight
        self._reused = False
        # (added, chained hash) of full blocks placed and evicted since the last drain_events,
        # while recording (None: not)
        self._events: list[tuple[bool, bytes]] | None = None

    def record_events(self) -> None:
        """From now on, record full blocks placed and evicted (`drain_events`)."""
        if self._events is None:
            self._events = []

    def drain_events(self) -> list[tuple[bool, bytes]]:
        """(True, hash) for each full block placed, (False, hash) for each evicted, in order,
        since the last call. NOTE: drained every housekeeping turn, as the pool's, so bounded."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The slot holding exactly these tokens under this hash (most recently used now)."""
        entry = self._slots.get(block_hash)
        if entry is None or entry[1] != tuple(token_ids):
            return None
        self._slots.move_to_end(block_hash)
        self.num_hits += 1
        self._found.add(entry[0])
        return entry[0]

    def place(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """A slot for a block about to be saved: free, else the least recently used one's
        (None: every slot is about to be read)."""
        if block_hash in self._slots:
            raise ValueError("that block is in the host tier already")
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, (s, _) in self._slots.items() if s not in self._found), None)
            if victim is None:
                return None
            slot, _ = self._slots.pop(victim)
            self.num_evictions += 1
            self._record(False, victim)
        self._slots[block_hash] = (slot, tuple(token_ids))
        self._record(True, block_hash)
        return slot

    def _record(self, added: bool, block_hash: bytes) -> None:
        if self._events is not None and not is_partial_key(block_hash):
            self._events.append((added, block_hash))

    def save(self, block_id: int, slot: int | None) -> None:
        """Queue a block's copy to the slot `place` gave it (None: no room, no copy)."""
        if slot is not None:
            self._saves.append((block_id, slot))
            self._saving.add(block_id)

    def load(self, slot: int, block_id: int) -> None:
        """Queue a host hit's copy back into the new block it was given."""
        self._loads.append((slot, block_id))

    def taken(self, block_id: int) -> None:
        """`block_id` takes new tokens: the step must wait if its save may be in flight."""
        if block_id in self._saving:
            self._reused = True

    def drain(self) -> HostWork:
        """The copies owed before the next step (engine/host_tier.py issues them); the slots
        found since the last drain may be reused again."""
        work = HostWork(tuple(self._saves), tuple(self._loads), self._reused)
        self._saves, self._loads, self._reused = [], [], False
        self._found.clear()
        return work

    def saves_done(self) -> None:
        """Every save issued so far has landed: their blocks may take new tokens freely."""
        self._saving = {block_id for block_id, _ in self._saves}
