"""The block manager's snapshot and self-check (`BlockManager` inherits them): what its pool
holds, and the proof that every block and window slot is free, cached or held exactly as
often as the sequences and transfers that hold it say."""

from __future__ import annotations

from collections.abc import Hashable

from splitserve.engine.block_pool import BlockIntegrityError, BlockPool
from splitserve.engine.block_types import KVUsage
from splitserve.engine.window_slots import WindowSlots


class BlockAudit:
    """`usage` and `check_integrity` over a `BlockManager`'s tables, pins and pools."""

    block_size: int
    pool: BlockPool
    window: WindowSlots | None
    _tables: dict[Hashable, list[int]]
    _num_tokens: dict[Hashable, int]
    _live_from: dict[Hashable, int]
    _pins: dict[int, int]
    _window_pins: dict[int, int]

    def usage(self) -> KVUsage:
        pool = self.pool
        unused = sum(
            len(table) * self.block_size - self._num_tokens[seq_id]
            for seq_id, table in self._tables.items()
        )
        return KVUsage(
            num_total_blocks=pool.num_blocks,
            num_used_blocks=pool.num_blocks - pool.num_free - pool.num_cached,
            num_cached_blocks=pool.num_cached,
            num_free_blocks=pool.num_free,
            num_unused_slots=unused,
            num_sequences=len(self._tables),
            num_window_slots_held=self.window.num_held if self.window else 0,
            num_window_slots=self.window.num_slots - 1 if self.window else 0,
        )

    def check_integrity(self) -> None:
        """Raise BlockIntegrityError unless free + cached + in use == total and every reference
        count equals the number of block tables holding that block."""
        refs: dict[int, int] = {}
        seen: dict[int, int] = {}  # block id -> sequences whose window covers it
        for seq_id, table in self._tables.items():
            if len(table) != -(-self._num_tokens[seq_id] // self.block_size):
                raise BlockIntegrityError(f"sequence {seq_id!r} holds more blocks than tokens need")
            for block_id in table:
                refs[block_id] = refs.get(block_id, 0) + 1
            for block_id in table[self._live_from[seq_id] :]:
                seen[block_id] = seen.get(block_id, 0) + 1
        for block_id, count in self._pins.items():
            refs[block_id] = refs.get(block_id, 0) + count
        for block_id, count in self._window_pins.items():
            seen[block_id] = seen.get(block_id, 0) + count
        self.pool.check_integrity(refs)
        if self.window is not None:
            self.window.check_integrity(seen)
            stale = [
                b for b in self.window.slot_of if b not in refs and not self.pool.is_evictable(b)
            ]
            if stale:
                raise BlockIntegrityError(f"free blocks still hold window slots: {stale[:5]}")
