"""What the block manager hands out: a prefix hit, an allocation's copies, a usage snapshot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks that already hold a prompt's leading tokens: on the GPU (`block_ids`),
    then in the host tier (`host_blocks`: slot, hash, tokens; copied back into new blocks)."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    host_blocks: tuple[tuple[int, bytes, tuple[int, ...]], ...] = ()
    # A preempted sequence's partly filled last block, swapped out: (host slot, its tokens).
    partial: tuple[int, int] | None = None

    def num_tokens(self, block_size: int) -> int:
        full = (len(self.block_ids) + len(self.host_blocks)) * block_size
        return full + (self.partial[1] if self.partial else 0)


@dataclass(frozen=True)
class Allocation:
    """What the runner must do before this step's forward: copy `src` block into `dst`."""

    copies: tuple[tuple[int, int], ...] = ()


_NO_COPIES = Allocation()


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the KV pool, in blocks and token slots."""

    num_total_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    # Slots allocated to sequences that hold no token yet: the waste paging keeps to at most one
    # partly filled block per sequence.
    num_unused_slots: int
    num_sequences: int
    # Sliding-window layers' slots (engine/window_slots.py): in use, and all but the null one.
    num_window_slots_held: int = 0
    num_window_slots: int = 0

    @property
    def usage_perc(self) -> float:
        return self.num_used_blocks / self.num_total_blocks
