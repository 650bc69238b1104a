"""Sliding-window layers' storage: a second, smaller pool of slots that only the blocks some
sequence can still see hold.

A sliding layer's query at position p sees keys at positions > p - window. Once a sequence's
next query is at c, its blocks that end at or before c - window are dead to it: no query of it
will read them again. The full layers still need them (their pool keeps every block); the
sliding layers do not, so their keys and values live apart, in slots handed out per block:

    block table        [ b7 ][ b2 ][ b9 ][ b4 ][ b1 ]        (full layers: every block)
    live for the seq               └── window ──┘ + the block being written
    window map          b2 -> 0, b9 -> 5, b4 -> 3, b1 -> 8    (sliding layers: slot, 0 = none)

Slot 0 is never handed out and stays zero: a dead block's table entry reads it, masked away by
the window. Each block with a slot counts the sequences that still see it; at zero its slot
goes idle (LRU), keeping its keys and values for a prefix hit until a new block needs the slot.
A prefix hit is usable only up to where every block its first query sees still has a slot
(`usable_prefix`).

Bookkeeping only: the engine mirrors `drain_changes` into the device's window map
(kv_cache.py) that the model translates block tables through.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from splitserve.engine.block_pool import BlockIntegrityError


def first_live_block(position: int, window: int, block_size: int) -> int:
    """Index of the first block a query at `position` (or later) still sees."""
    return max(0, (position - window + 1) // block_size)


def slots_needed(window: int, block_size: int, max_num_seqs: int, max_batched: int) -> int:
    """Slots enough for every running sequence's window, the block it writes and a step's new
    tokens (the pool never needs more; the block manager checks anyway)."""
    per_seq = -(-(window - 1) // block_size) + 2
    return max_num_seqs * (per_seq + 1) + -(-max_batched // block_size)


class WindowSlots:
    """Which block holds which sliding-layer slot, and who still sees it."""

    def __init__(self, num_slots: int, window: int, block_size: int) -> None:
        if num_slots < 2:
            raise ValueError("a sliding-window pool needs at least one slot besides the null one")
        self.num_slots = num_slots
        self.window = window
        self.block_size = block_size
        self.slot_of: dict[int, int] = {}  # block id -> slot
        self._refs: dict[int, int] = {}  # block id (with a slot) -> sequences that see it
        self._free: deque[int] = deque(range(1, num_slots))
        self._idle: OrderedDict[int, None] = OrderedDict()  # blocks whose slot nobody sees
        self._changes: dict[int, int] = {}  # block id -> its slot now (0: none), since drained

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_held(self) -> int:
        """Slots some sequence still sees."""
        return len(self._refs) - len(self._idle)

    def first_live(self, position: int) -> int:
        return first_live_block(position, self.window, self.block_size)

    def is_idle(self, block_id: int) -> bool:
        return block_id in self._idle

    def give(self, block_id: int) -> None:
        """A slot for a new block, seen by the one sequence that allocated it."""
        if block_id in self.slot_of:
            raise BlockIntegrityError(f"block {block_id} already holds a window slot")
        if self._free:
            slot = self._free.popleft()
        elif self._idle:
            victim, _ = self._idle.popitem(last=False)
            slot = self._forget(victim)
        else:
            raise BlockIntegrityError("give() called with no window slot available")
        self.slot_of[block_id] = slot
        self._refs[block_id] = 1
        self._changes[block_id] = slot

    def hold(self, block_id: int) -> None:
        """One more sequence sees `block_id` (a prefix hit or a fork); it must hold a slot."""
        if block_id not in self.slot_of:
            raise BlockIntegrityError(f"block {block_id} is seen but holds no window slot")
        if self._refs[block_id] == 0:
            self._idle.pop(block_id)
        self._refs[block_id] += 1

    def let_go(self, block_id: int) -> None:
        """One sequence no longer sees `block_id`: the window moved past it, or it ended."""
        count = self._refs.get(block_id, 0)
        if count <= 0:
            raise BlockIntegrityError(f"block {block_id} let go more often than held")
        self._refs[block_id] = count - 1
        if count == 1:
            self._idle[block_id] = None

    def drop(self, block_id: int) -> None:
        """`block_id` is freed or reused for other tokens: its slot's contents are stale."""
        if block_id not in self.slot_of:
            return
        if self._refs[block_id] != 0:
            raise BlockIntegrityError(f"block {block_id} dropped while a sequence sees it")
        self._idle.pop(block_id)
        self._free.append(self._forget(block_id))

    def usable_prefix(self, block_ids: Sequence[int]) -> int:
        """How many of a prefix hit's leading blocks can be used: the first query after them
        must find a slot in every block it sees."""
        usable = len(block_ids)
        while usable:
            start = self.first_live(usable * self.block_size)
            missing = [j for j in range(start, usable) if block_ids[j] not in self.slot_of]
            if not missing:
                return usable
            usable = missing[-1]
        return 0

    def drain_changes(self) -> list[tuple[int, int]]:
        """(block id, slot or 0) for every block whose slot changed since the last call."""
        changes, self._changes = self._changes, {}
        return list(changes.items())

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """Raise BlockIntegrityError unless each slot is free or owned once, and each block's
        count equals the sequences that see it (`expected_refs`)."""
        owned = list(self.slot_of.values())
        if len(set(owned)) != len(owned) or set(owned) & set(self._free) or 0 in owned:
            raise BlockIntegrityError("a window slot is owned twice, or owned and free")
        if len(owned) + len(self._free) != self.num_slots - 1:
            raise BlockIntegrityError(
                f"window slots: {len(owned)} owned + {len(self._free)} free != {self.num_slots - 1}"
            )
        for block_id, count in self._refs.items():
            if count != expected_refs.get(block_id, 0):
                raise BlockIntegrityError(
                    f"block {block_id}'s window slot is seen by {count} sequences, "
                    f"expected {expected_refs.get(block_id, 0)}"
                )
            if (count == 0) != (block_id in self._idle):
                raise BlockIntegrityError(f"block {block_id}'s window slot idles wrongly")
        unslotted = set(expected_refs) - set(self.slot_of)
        if unslotted:
            raise BlockIntegrityError(f"blocks seen without a window slot: {sorted(unslotted)}")

    def _forget(self, block_id: int) -> int:
        slot = self.slot_of.pop(block_id)
        del self._refs[block_id]
        self._changes[block_id] = 0
        return slot
