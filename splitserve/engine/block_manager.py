"""Per-sequence block tables over the block pool: allocation on demand, prefix hits, fork and
copy-on-write.

A sequence's table covers exactly the tokens it has slots for, so at most its last block is
partly filled:

    block table   [ b7 ][ b2 ][ b9 ]
    tokens        |0..15|16..31|32..37 ......|   <- 10 unused slots, all in the last block

Full blocks are hashed (chained over the parent hash) once computed and stay in the pool's
prefix cache after release. A forked child shares every block of its parent; whichever of them
next writes into a shared, partly filled last block first copies it (copy-on-write).

With sliding-window layers (`window`: engine/window_slots.py) a block also holds a slot of
their smaller pool while some sequence's window still covers it: `allocate` is told where a
sequence's next query is (`num_computed`) and lets go of the blocks behind its window. A new
sequence whose first query comes after its blocks (a decode worker's reservation: the KV
arrives from elsewhere) gets slots only for the blocks that query sees. A transfer pins the
slots it reads or writes with the blocks (`pin(..., window=True)`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from splitserve.engine.block_audit import BlockAudit
from splitserve.engine.block_pool import (
    BlockIntegrityError,
    BlockPool,
)
from splitserve.engine.block_types import _NO_COPIES, Allocation, KVUsage, PrefixHit
from splitserve.engine.host_index import HostIndex, partial_key
from splitserve.engine.prefix_hash import chain_hash, prefix_block_hashes
from splitserve.engine.window_slots import WindowSlots

SeqId = Hashable

__all__ = ["Allocation", "BlockManager", "KVUsage", "PrefixHit", "SeqId"]


class BlockManager(BlockAudit):
    """Maps each sequence to its blocks; the scheduler asks it whether work fits."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_prefix_events: bool = False,
        window: WindowSlots | None = None,
        host: HostIndex | None = None,
    ):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching, record_prefix_events)
        self.window = window
        # The host-memory tier (engine/host_index.py), and the copies it owes the pool.
        self.host = host if enable_prefix_caching else None
        # The first block each sequence's window still covers (with `window` only).
        self._live_from: dict[SeqId, int] = {}
        self._tables: dict[SeqId, list[int]] = {}
        self._num_tokens: dict[SeqId, int] = {}
        self._hashes: dict[SeqId, list[bytes]] = {}
        self._pins: dict[int, int] = {}  # block id -> pins held for KV transfers in flight
        self._window_pins: dict[int, int] = {}  # block id -> those of them holding its slot
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def block_table(self, seq_id: SeqId) -> list[int]:
        return self._tables[seq_id]

    def has_seq(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def find_prefix_hit(
        self, token_ids: Sequence[int], root: bytes | None = None, swapped: bool = False
    ) -> PrefixHit | None:
        """The longest run of cached full blocks at the start of `token_ids` (never the block
        holding the last token: its logits are needed); `root` keys them by LoRA adapter.
        `swapped`: a preempted sequence, whose partly filled last block `swap_out` may have
        kept in the host tier (then every token but the last is a hit)."""
        if not self.pool.enable_caching:
            return None
        bs = self.block_size
        self.prefix_cache_queries += len(token_ids)
        ids: list[int] = []
        hashes = prefix_block_hashes(token_ids, bs, root)
        for i, block_hash in enumerate(hashes):
            block_id = self.pool.lookup(block_hash, token_ids[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            ids.append(block_id)
        if self.window is not None:
            del ids[self.window.usable_prefix(ids) :]
        host: list[tuple[int, bytes, tuple[int, ...]]] = []
        if self.host is not None:  # NOTE: never with a window pool (llm_engine refuses both)
            for i in range(len(ids), len(hashes)):
                chunk = tuple(token_ids[i * bs : (i + 1) * bs])
                slot = self.host.lookup(hashes[i], chunk)
                if slot is None:
                    break
                host.append((slot, hashes[i], chunk))
        partial = None
        if swapped and self.host is not None and len(ids) + len(host) == len(hashes):
            rest = token_ids[len(hashes) * bs : len(token_ids) - 1]
            parent = hashes[-1] if hashes else root
            slot = self.host.lookup(partial_key(parent, rest), rest) if rest else None
            partial = None if slot is None else (slot, len(rest))
        if not ids and not host and partial is None:
            return None
        hit = PrefixHit(tuple(ids), tuple(hashes[: len(ids)]), tuple(host), partial)
        self.prefix_cache_hits += hit.num_tokens(bs)
        return hit

    def swap_out(
        self, seq_id: SeqId, token_ids: Sequence[int], num_computed: int, root: bytes | None
    ) -> None:
        """Before a preemption frees `seq_id`: keep its partly filled last block in the host
        tier (its full blocks are there already, written through when hashed), so that it
        resumes without computing any token again."""
        bs, table = self.block_size, self._tables.get(seq_id)
        if self.host is None or table is None or num_computed % bs == 0:
            return
        full = num_computed // bs
        hashes = self._hashes[seq_id]
        if len(hashes) < full or len(table) <= full:
            return
        rest = tuple(token_ids[full * bs : num_computed])
        key = partial_key(hashes[full - 1] if full else root, rest)
        if key not in self.host:
            self.host.save(table[full], self.host.place(key, rest))

    def can_allocate(
        self,
        seq_id: SeqId,
        num_total_tokens: int,
        prefix_hit: PrefixHit | None = None,
        num_computed: int | None = None,
    ) -> bool:
        needed = self._blocks_needed(seq_id, num_total_tokens, prefix_hit)
        # Hit blocks that sit in the LRU will be taken by the hit, so they can't also be evicted.
        taken = 0
        if prefix_hit is not None:
            taken = sum(self.pool.is_evictable(b) for b in prefix_hit.block_ids)
        if needed > self.pool.num_available - taken:
            return False
        return self.window is None or self._slots_fit(seq_id, needed, prefix_hit, num_computed)

    def allocate(
        self,
        seq_id: SeqId,
        num_total_tokens: int,
        prefix_hit: PrefixHit | None = None,
        num_computed: int | None = None,
    ) -> Allocation | None:
        """Give `seq_id` slots for its first `num_total_tokens` tokens, or None if they don't fit.

        A new sequence may start from `prefix_hit`. `num_computed`: where the sequence's next
        query is (no earlier position is queried again): with sliding-window layers, the
        blocks behind its window are let go first; a new sequence's blocks before the first
        one that query sees get no window slot. Nothing else changes when None is returned.
        """
        if num_computed is not None and self.window is not None:
            self._slide(seq_id, num_computed)
        table = self._tables.get(seq_id)
        if (
            table is not None
            and prefix_hit is None
            and num_total_tokens <= len(table) * self.block_size
            and not self._needs_copy(seq_id, num_total_tokens)
        ):  # most decode steps: the next slot is in a block the sequence holds alone
            if num_total_tokens > self._num_tokens[seq_id]:
                self._num_tokens[seq_id] = num_total_tokens
            return _NO_COPIES
        if not self.can_allocate(seq_id, num_total_tokens, prefix_hit, num_computed):
            return None
        if table is None:
            table = self._tables[seq_id] = []
            self._hashes[seq_id] = []
            self._num_tokens[seq_id] = 0
            self._live_from[seq_id] = 0
            if prefix_hit is not None:
                for block_id in prefix_hit.block_ids:
                    self.pool.touch(block_id)
                table.extend(prefix_hit.block_ids)
                self._hashes[seq_id].extend(prefix_hit.block_hashes)
                self._num_tokens[seq_id] = prefix_hit.num_tokens(self.block_size)
            if self.window is not None:
                live = self._first_live(prefix_hit, num_computed)
                self._live_from[seq_id] = live
                for block_id in table[live:]:
                    self.window.hold(block_id)
            if prefix_hit is not None and self.host is not None:
                # a hit's host blocks come back into new ones
                # NOTE: ascending, so that the loads run as few long copies
                new = sorted(self._take() for _ in prefix_hit.host_blocks)
                for block_id, (slot, block_hash, tokens) in zip(
                    new, prefix_hit.host_blocks, strict=True
                ):
                    table.append(block_id)
                    self._hashes[seq_id].append(block_hash)
                    self.pool.cache(block_id, block_hash, tokens)
                    self.host.load(slot, block_id)
                if prefix_hit.partial is not None:  # swapped back in; hashed once full
                    table.append(self._take())
                    self.host.load(prefix_hit.partial[0], table[-1])
        copies = []
        if self._needs_copy(seq_id, num_total_tokens):
            shared = table[-1]
            table[-1] = self._take()
            self._let_go(shared)
            self._release(shared)
            copies.append((shared, table[-1]))
        live = self._live_from[seq_id]
        while len(table) * self.block_size < num_total_tokens:
            table.append(self._take(slot=len(table) >= live))
        self._num_tokens[seq_id] = max(self._num_tokens[seq_id], num_total_tokens)
        return Allocation(tuple(copies))

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give `child_id` the parent's blocks, shared (reference counts go up)."""
        if child_id in self._tables:
            raise BlockIntegrityError(f"sequence {child_id!r} already has blocks")
        table = list(self._tables[parent_id])
        for block_id in table:
            self.pool.touch(block_id)
        self._live_from[child_id] = live = self._live_from[parent_id]
        if self.window is not None:
            for block_id in table[live:]:
                self.window.hold(block_id)
        self._tables[child_id] = table
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._hashes[child_id] = list(self._hashes[parent_id])

    def pin(self, block_id: int, window: bool = False) -> int:
        """Hold a block for a transfer in flight: nothing frees, evicts or reuses it until
        `unpin`, whatever happens to the sequences that hold it. With `window`, its sliding
        layers' slot too, if it holds one (`unpin` it with `window` then): returns that slot
        (0: none)."""
        self.pool.touch(block_id)
        self._pins[block_id] = self._pins.get(block_id, 0) + 1
        if not window or self.window is None or block_id not in self.window.slot_of:
            return 0
        self.window.hold(block_id)
        self._window_pins[block_id] = self._window_pins.get(block_id, 0) + 1
        return self.window.slot_of[block_id]

    def window_slot(self, block_id: int) -> int:
        """The sliding layers' slot `block_id` holds (0: none, or no window pool)."""
        return self.window.slot_of.get(block_id, 0) if self.window is not None else 0

    def unpin(self, block_id: int, window: bool = False) -> None:
        if window:  # NOTE: before the block's own pin: a freed block drops an unseen slot
            held = self._window_pins.get(block_id, 0)
            if held <= 0 or self.window is None:
                raise BlockIntegrityError(f"block {block_id}'s window slot was not pinned")
            if held == 1:
                del self._window_pins[block_id]
            else:
                self._window_pins[block_id] = held - 1
            self.window.let_go(block_id)
        count = self._pins.get(block_id, 0)
        if count <= 0:
            raise BlockIntegrityError(f"block {block_id} unpinned more often than pinned")
        if count == 1:
            del self._pins[block_id]
        else:
            self._pins[block_id] = count - 1
        self._release(block_id)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pins)

    def free(self, seq_id: SeqId) -> None:
        """Release a sequence's blocks. Tail first, so the LRU evicts a prompt's end before its
        shared beginning."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        live = self._live_from.pop(seq_id)
        for i in reversed(range(len(table))):
            if i >= live:
                self._let_go(table[i])
            self._release(table[i])
        del self._num_tokens[seq_id]
        del self._hashes[seq_id]

    def cache_blocks(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        num_computed: int,
        root: bytes | None = None,
    ) -> None:
        """Hash and register every block of `seq_id` that is full and computed (chained from
        `root`, the sequence's LoRA adapter's, as `find_prefix_hit` looks them up)."""
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        hashes, table = self._hashes[seq_id], self._tables[seq_id]
        for i in range(len(hashes), num_computed // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            hashes.append(chain_hash(hashes[-1] if hashes else root, chunk))
            self.pool.cache(table[i], hashes[-1], chunk)
            if self.host is not None and hashes[-1] not in self.host:
                # NOTE: written through now, so evicting it later costs no copy
                self.host.save(table[i], self.host.place(hashes[-1], chunk))

    def trim(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrink `seq_id` to slots for its first `num_tokens` tokens, releasing the blocks
        past them (speculative decoding's rollback of rejected drafts). Never below the
        hashed (full, computed) blocks."""
        table = self._tables[seq_id]
        if num_tokens < len(self._hashes[seq_id]) * self.block_size:
            raise BlockIntegrityError(f"trim of {seq_id!r} below its cached blocks")
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            block_id = table.pop()
            if len(table) >= self._live_from[seq_id]:
                self._let_go(block_id)
            self._release(block_id)
        self._num_tokens[seq_id] = min(self._num_tokens[seq_id], num_tokens)

    def _needs_copy(self, seq_id: SeqId, num_total_tokens: int) -> bool:
        # The next token lands in the last block if it is partly filled; if that block is
        # shared with a forked sibling, writing in place would corrupt the sibling's KV.
        table = self._tables.get(seq_id)
        if not table:
            return False
        num_tokens = self._num_tokens[seq_id]
        return (
            num_total_tokens > num_tokens
            and num_tokens % self.block_size != 0
            and self.pool.blocks[table[-1]].ref_count > 1
        )

    def _blocks_needed(
        self, seq_id: SeqId, num_total_tokens: int, prefix_hit: PrefixHit | None
    ) -> int:
        held = len(self._tables.get(seq_id, ()))
        if seq_id not in self._tables and prefix_hit is not None:
            held = len(prefix_hit.block_ids)
        needed = max(0, -(-num_total_tokens // self.block_size) - held)
        return needed + int(self._needs_copy(seq_id, num_total_tokens))

    def _first_live(self, prefix_hit: PrefixHit | None, num_computed: int | None) -> int:
        """The first block a new sequence's window holds: its first query's (after its hit)."""
        assert self.window is not None
        hit = prefix_hit.num_tokens(self.block_size) if prefix_hit is not None else 0
        return self.window.first_live(max(hit, num_computed or 0))

    def _slots_fit(
        self, seq_id: SeqId, needed: int, prefix_hit: PrefixHit | None, num_computed: int | None
    ) -> bool:
        """Whether the window pool has a slot for every new block that needs one."""
        window = self.window
        assert window is not None
        if seq_id in self._tables:
            return needed <= window.num_available
        held = len(prefix_hit.block_ids) if prefix_hit is not None else 0
        live = self._first_live(prefix_hit, num_computed)
        slotted = max(0, held + needed - max(held, live))
        taken = 0  # idle hit blocks the hit takes back
        if prefix_hit is not None:
            taken = sum(window.is_idle(b) for b in prefix_hit.block_ids[live:])
        return slotted <= window.num_available - taken

    def _take(self, slot: bool = True) -> int:
        """A block for new tokens (and, with `slot`, its window slot): evicting a cached block
        makes its old window slot's contents stale."""
        block_id = self.pool.allocate()
        if self.host is not None:
            self.host.taken(block_id)
        if self.window is not None:
            self.window.drop(block_id)
            if slot:
                self.window.give(block_id)
        return block_id

    def _release(self, block_id: int) -> None:
        self.pool.release(block_id)
        block = self.pool.blocks[block_id]
        if self.window is not None and block.ref_count == 0 and block.block_hash is None:
            self.window.drop(block_id)  # freed: nothing can hit it any more

    def _let_go(self, block_id: int) -> None:
        if self.window is not None:
            self.window.let_go(block_id)

    def _slide(self, seq_id: SeqId, num_computed: int) -> None:
        """Let go of the blocks behind `seq_id`'s window, its next query being at
        `num_computed`."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        assert self.window is not None
        old = self._live_from[seq_id]
        new = min(self.window.first_live(num_computed), len(table))
        for block_id in table[old:new]:
            self.window.let_go(block_id)
        self._live_from[seq_id] = max(old, new)
