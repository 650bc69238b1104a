"""The paged-KV block manager: a stateful model check, plus unit tests of prefix caching, the LRU
of released blocks and fork with copy-on-write."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from splitserve.engine import block_manager as block_manager_module
from splitserve.engine import prefix_hash as prefix_hash_module
from splitserve.engine.block_manager import BlockManager


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def snapshot(bm: BlockManager) -> tuple:
    """Everything an allocation could change."""
    pool = bm.pool
    return (
        bm.usage(),
        {seq_id: list(table) for seq_id, table in bm._tables.items()},
        dict(bm._num_tokens),
        {seq_id: list(hashes) for seq_id, hashes in bm._hashes.items()},
        [(b.ref_count, b.block_hash, b.token_ids) for b in pool.blocks],
        list(pool._free),
        list(pool._evictable),
        dict(pool._by_hash),
    )


def admit(bm: BlockManager, seq_id: object, tokens: list[int]):
    """Schedule a prompt as the scheduler does (prefix hit first), compute it, cache its blocks."""
    hit = bm.find_prefix_hit(tokens)
    assert bm.allocate(seq_id, len(tokens), hit) is not None
    bm.cache_blocks(seq_id, tokens, len(tokens))
    return hit


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, appends, forks, frees and preemptions against a model of each live
    sequence's tokens and of every block's contents.

    A slot's simulated KV is the whole token prefix ending at it (real KV depends on every earlier
    token and on the position), so a slot reached by the wrong prefix, a stale block or a shared
    block written in place shows up as a mismatch.
    """

    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.tokens: dict[int, list[int]] = {}  # live sequence -> its tokens (== its slots)
        self.preempted: dict[int, list[int]] = {}
        self.prompts: list[list[int]] = [[]]  # token lists seen, to draw colliding prefixes from
        self.kv: dict[int, list[tuple[int, ...] | None]] = {}
        self.next_id = 0

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([2, 4, 16]))
    def make_manager(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=self.caching)
        self.kv = {b: [None] * block_size for b in range(num_blocks)}

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        base = data.draw(st.sampled_from(self.prompts))
        head = base[: data.draw(st.integers(0, len(base)) | st.just(len(base)))]
        tail = data.draw(st.lists(st.integers(0, 1), max_size=self.bs + 1))
        return (head + tail)[: 3 * self.bs + 1] or [0]

    def write(self, seq_id: int, start: int) -> None:
        """The forward pass writes the KV of tokens[start:] into the sequence's slots."""
        toks, table = self.tokens[seq_id], self.bm.block_table(seq_id)
        for p in range(start, len(toks)):
            self.kv[table[p // self.bs]][p % self.bs] = tuple(toks[: p + 1])

    def room(self, hit_blocks: tuple[int, ...] = ()) -> int:
        """Blocks an allocation may take, counted from reference counts alone."""
        idle = {b.block_id for b in self.bm.pool.blocks if b.ref_count == 0}
        return len(idle - set(hit_blocks))

    def start(self, seq_id: int, toks: list[int]) -> bool:
        bm, bs = self.bm, self.bs
        hit = bm.find_prefix_hit(toks)
        hit_blocks = hit.block_ids if hit else ()
        if hit is not None:
            assert bm.pool.enable_caching
            assert 0 < len(hit_blocks) <= (len(toks) - 1) // bs
            for i, b in enumerate(hit_blocks):  # the hit really holds this prompt's KV
                assert self.kv[b] == [tuple(toks[: i * bs + j + 1]) for j in range(bs)]
        before = snapshot(bm)
        alloc = bm.allocate(seq_id, len(toks), hit)
        if alloc is None:
            assert snapshot(bm) == before
            assert cdiv(len(toks), bs) - len(hit_blocks) > self.room(hit_blocks)
            return False
        assert alloc.copies == ()
        assert bm.block_table(seq_id)[: len(hit_blocks)] == list(hit_blocks)
        self.tokens[seq_id] = list(toks)
        self.write(seq_id, len(hit_blocks) * bs)
        bm.cache_blocks(seq_id, toks, len(toks))
        return True

    @rule(data=st.data())
    def admit_new_sequence(self, data: st.DataObject) -> None:
        toks = self.draw_prompt(data)
        self.next_id += 1
        if self.start(self.next_id, toks):
            self.prompts.append(toks)

    @precondition(lambda self: len(self.prompts) > 1)
    @rule(data=st.data())
    def admit_earlier_prompt_again(self, data: st.DataObject) -> None:
        self.next_id += 1
        self.start(self.next_id, data.draw(st.sampled_from(self.prompts[1:])))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append_tokens(self, data: st.DataObject) -> None:
        bm, bs = self.bm, self.bs
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        new = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=bs + 1))
        toks = self.tokens[seq_id]
        old, last = len(toks), bm.block_table(seq_id)[-1]
        sharers = sum(last in bm.block_table(s) for s in self.tokens)
        must_copy = old % bs != 0 and sharers > 1
        needed = cdiv(old + len(new), bs) - cdiv(old, bs) + must_copy
        before = snapshot(bm)
        alloc = bm.allocate(seq_id, old + len(new))
        if alloc is None:
            assert snapshot(bm) == before
            assert needed > self.room()
            return
        table = bm.block_table(seq_id)
        if must_copy:  # the partly filled last block was shared: write into a private copy
            assert alloc.copies == ((last, table[old // bs]),)
            self.kv[table[old // bs]] = list(self.kv[last])
        else:
            assert alloc.copies == ()
            assert table[old // bs] == last or old % bs == 0
        toks.extend(new)
        self.write(seq_id, old)
        bm.cache_blocks(seq_id, toks, len(toks))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork_sequence(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        self.next_id += 1
        self.bm.fork(parent, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[parent])
        assert self.bm.block_table(self.next_id) == self.bm.block_table(parent)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def free_or_preempt_sequence(self, data: st.DataObject, preempt: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        assert not self.bm.has_seq(seq_id)
        toks = self.tokens.pop(seq_id)
        if preempt:  # back to the waiting queue; re-admitted from scratch later
            self.preempted[seq_id] = toks

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume_preempted_from_scratch(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.preempted)))
        if self.start(seq_id, self.preempted[seq_id]):
            del self.preempted[seq_id]

    @invariant()
    def bookkeeping_matches_the_model(self) -> None:
        bm, bs = self.bm, self.bs
        if bm is None:
            return
        bm.check_integrity()
        u = bm.usage()
        assert u.num_used_blocks + u.num_cached_blocks + u.num_free_blocks == u.num_total_blocks
        assert u.num_sequences == len(self.tokens)
        if not bm.pool.enable_caching:
            assert u.num_cached_blocks == 0
        # Only full blocks are ever hashed (a partly filled one is still being written).
        assert all(len(b.token_ids) == bs for b in bm.pool.blocks if b.block_hash is not None)
        waste = 0
        holders: dict[int, list[tuple[int, int]]] = {}
        for seq_id, toks in self.tokens.items():
            table = bm.block_table(seq_id)
            assert len(table) == cdiv(len(toks), bs)
            waste += len(table) * bs - len(toks)
            for p in range(len(toks)):  # every slot holds the KV of this sequence's prefix
                assert self.kv[table[p // bs]][p % bs] == tuple(toks[: p + 1])
            for i, b in enumerate(table):
                holders.setdefault(b, []).append((seq_id, i))
        assert u.num_unused_slots == waste <= u.num_sequences * (bs - 1)
        assert u.num_used_blocks == len(holders)
        for held in holders.values():
            # A shared block sits at one position, at most once per table, and every holder has
            # the same tokens in it: a partly filled one is never shared after someone appended.
            assert len({i for _, i in held}) == 1
            assert len({s for s, _ in held}) == len(held)
            i = held[0][1]
            assert len({tuple(self.tokens[s][i * bs : (i + 1) * bs]) for s, _ in held}) == 1

    def teardown(self) -> None:
        bm = self.bm
        if bm is None:
            return
        for seq_id in list(self.tokens):
            bm.free(seq_id)
        bm.check_integrity()
        u = bm.usage()
        assert (u.num_used_blocks, u.num_sequences, u.num_unused_slots) == (0, 0, 0)
        assert u.num_free_blocks + u.num_cached_blocks == u.num_total_blocks
        # Nothing leaked: the whole pool can be taken again (cached blocks get evicted).
        assert bm.allocate("all", u.num_total_blocks * bm.block_size) is not None
        bm.check_integrity()


class NoPrefixCachingMachine(BlockManagerMachine):
    caching = False


MACHINE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
BlockManagerMachine.TestCase.settings = MACHINE_SETTINGS
NoPrefixCachingMachine.TestCase.settings = settings(MACHINE_SETTINGS, max_examples=50)
TestBlockManagerWithPrefixCaching = BlockManagerMachine.TestCase
TestBlockManagerWithoutPrefixCaching = NoPrefixCachingMachine.TestCase


def test_shared_prompt_hits_the_cache_and_counts_hit_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks and a partly filled one
    assert admit(bm, "a", prompt) is None
    hit = admit(bm, "b", prompt)
    assert hit is not None and hit.num_tokens(4) == 8
    a, b = bm.block_table("a"), bm.block_table("b")
    assert b[:2] == a[:2] and b[2] != a[2]  # the partly filled block is never shared
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)
    assert bm.usage().num_used_blocks == 4
    bm.check_integrity()


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly two full blocks, both cached
    admit(bm, "a", prompt)
    hit = bm.find_prefix_hit(prompt)
    assert hit is not None and hit.block_ids == tuple(bm.block_table("a")[:1])
    assert bm.find_prefix_hit(prompt[:4]) is None  # one block: its last token must be computed
    assert bm.prefix_cache_hits == 4


def test_hash_collision_between_different_tokens_serves_no_block(monkeypatch) -> None:
    # Every block hashes alike, where blocks are cached (block_manager) and looked up (prefix_hash).
    def collide(parent, tokens):
        return b"\0" * 16

    monkeypatch.setattr(block_manager_module, "chain_hash", collide)
    monkeypatch.setattr(prefix_hash_module, "chain_hash", collide)
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, "a", [1, 2, 3, 4, 5])
    head = bm.block_table("a")[0]
    assert bm.pool.lookup(b"\0" * 16, [1, 2]) == head
    assert bm.pool.lookup(b"\0" * 16, [7, 8]) is None
    assert bm.find_prefix_hit([7, 8, 3, 4, 5]) is None
    admit(bm, "b", [7, 8, 3, 4, 5])
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.check_integrity()


def test_lru_evicts_the_least_recently_released_block_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    admit(bm, "a", [1, 2, 9])
    admit(bm, "b", [3, 4, 9])
    bm.free("a")
    bm.free("b")  # cached: a's full block, then b's; their partly filled blocks are free
    assert bm.usage().num_cached_blocks == 2
    admit(bm, "c", [5, 6, 7, 8, 9])  # 3 blocks: both free ones, then one eviction
    assert bm.pool.num_evictions == 1
    assert bm.find_prefix_hit([1, 2, 9]) is None
    assert bm.find_prefix_hit([3, 4, 9]) is not None
    bm.check_integrity()


def test_free_releases_a_sequences_tail_blocks_before_its_head() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    admit(bm, "a", prompt)
    head = bm.block_table("a")[:2]
    bm.free("a")  # 3 full blocks cached, tail first; the partly filled one is free
    admit(bm, "x", [8, 8, 8])  # takes the free block, then evicts a's third block
    assert bm.pool.num_evictions == 1
    hit = bm.find_prefix_hit(prompt)
    assert hit is not None and list(hit.block_ids) == head


def test_prefix_hit_blocks_in_the_lru_are_not_counted_as_evictable_room() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    admit(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")  # 2 cached blocks + 1 free
    prompt = [1, 2, 3, 4, 9, 9, 9]  # hits both cached blocks, needs 2 more: only 1 left
    hit = bm.find_prefix_hit(prompt)
    assert hit is not None and len(hit.block_ids) == 2
    before = snapshot(bm)
    assert not bm.can_allocate("b", len(prompt), hit)
    assert bm.allocate("b", len(prompt), hit) is None
    assert snapshot(bm) == before
    assert admit(bm, "c", [1, 2, 3, 4, 9]) is not None  # needs 1 more: fits
    bm.check_integrity()


def test_fork_then_append_copies_on_write_once_per_sibling_that_writes_first() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, "p", [1, 2, 3, 4, 5, 6])
    full, last = bm.block_table("p")
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    assert bm.pool.blocks[last].ref_count == 3
    copies = {}
    for seq_id in ("p", "c1", "c2"):
        copies[seq_id] = bm.allocate(seq_id, 7).copies
        assert bm.block_table(seq_id)[0] == full  # a full shared block is never copied
        bm.check_integrity()
    assert copies["p"] == ((last, bm.block_table("p")[1]),)
    assert copies["c1"] == ((last, bm.block_table("c1")[1]),)
    assert copies["c2"] == () and bm.block_table("c2")[1] == last  # the last writer owns it
    assert len({bm.block_table(s)[1] for s in copies}) == 3
    assert all(bm.allocate(s, 8).copies == () for s in copies)  # already private
    bm.check_integrity()


def test_copy_on_write_needs_a_free_block_or_changes_nothing() -> None:
    for num_blocks, fits in ((2, True), (1, False)):
        bm = BlockManager(num_blocks, block_size=4)
        admit(bm, "q", [7])
        bm.fork("q", "d")
        before = snapshot(bm)
        alloc = bm.allocate("q", 2)  # q's shared, partly filled last block must be copied
        assert (alloc is not None) == fits
        if not fits:
            assert snapshot(bm) == before
        bm.check_integrity()


def test_free_of_an_unknown_sequence_is_a_noop() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    admit(bm, "a", [1, 2, 3])
    before = snapshot(bm)
    bm.free("never allocated")
    assert snapshot(bm) == before


def test_allocate_beyond_capacity_returns_none_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate("big", 13) is None and not bm.has_seq("big")
    admit(bm, "a", list(range(9)))  # 3 blocks: the whole pool
    before = snapshot(bm)
    assert bm.allocate("b", 1) is None
    assert bm.allocate("a", 13) is None
    assert snapshot(bm) == before
    assert bm.allocate("a", 12) is not None  # room left in its last block
    bm.check_integrity()
