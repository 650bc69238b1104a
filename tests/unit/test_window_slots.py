"""Sliding-window layers' slots (engine/window_slots.py) through the block manager: a sequence
holds slots only for the blocks its window still covers, blocks behind it go idle (kept for a
prefix hit) and are reused under pressure, a prefix hit stops where the window lost its slots,
and fork, copy-on-write, trim and free keep the counts exact."""

from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.window_slots import WindowSlots, first_live_block, slots_needed

BS = 16


def manager(num_blocks: int, num_slots: int, window: int) -> BlockManager:
    return BlockManager(num_blocks, BS, window=WindowSlots(num_slots, window, BS))


def run(bm: BlockManager, seq_id: str, tokens: list[int], chunk: int, upto: int) -> int:
    """Compute `tokens[:upto]` of `seq_id` as the scheduler does, `chunk` tokens a step (a
    prefix hit first); return the most window slots held in any step."""
    hit = None if bm.has_seq(seq_id) else bm.find_prefix_hit(tokens[:upto])
    done = hit.num_tokens(BS) if hit else 0
    most = 0
    while done < upto:
        new = min(chunk, upto - done)
        assert bm.allocate(seq_id, done + new, hit, num_computed=done) is not None
        hit = None
        assert bm.window is not None
        most = max(most, bm.window.num_held)
        done += new
        bm.cache_blocks(seq_id, tokens, done)
        bm.check_integrity()
    return most


def test_the_first_live_block_is_the_first_a_query_there_still_sees():
    # A query at p sees keys > p - window: with window 32, a query at 47 sees 16.. (block 1).
    assert first_live_block(47, 32, BS) == 1
    assert first_live_block(48, 32, BS) == 1  # sees 17..: block 1 still
    assert first_live_block(63, 32, BS) == 2
    assert first_live_block(10, 32, BS) == 0


def test_a_decoding_sequence_holds_its_window_and_the_block_it_writes():
    window = 64
    bm = manager(num_blocks=200, num_slots=40, window=window)
    tokens = list(range(1000))
    run(bm, "a", tokens, chunk=20, upto=20)
    for n in range(20, 1000):  # one decode step each
        assert bm.allocate("a", n + 1, num_computed=n) is not None
        assert bm.window is not None
        assert bm.window.num_held <= -(-(window - 1) // BS) + 2
        assert len(bm.block_table("a")) == -(-(n + 1) // BS)  # full layers: every block
    bm.check_integrity()
    bm.free("a")
    bm.check_integrity()
    assert bm.window is not None and bm.window.num_held == 0


def test_gemma3_270m_at_32k_tokens_holds_under_a_quarter_of_every_blocks_bytes():
    """Gemma-3-270M's shape (18 layers, every 6th full, window 512, 1 KV head of 256, bf16):
    a 32,768-token prompt computed in 2,048-token chunks, then 64 decode steps."""
    layers, full, window = 18, 3, 512
    layer_block = 2 * BS * 1 * 256 * 2  # keys and values of one block of one layer, bf16
    length = 32768
    bm = manager(num_blocks=length // BS + 8, num_slots=200, window=window)
    tokens = list(range(length + 64))
    during_prefill = run(bm, "s", tokens, chunk=2048, upto=length)
    held = []
    for n in range(length, length + 64):
        assert bm.allocate("s", n + 1, num_computed=n) is not None
        assert bm.window is not None
        held.append(bm.window.num_held)
    blocks = len(bm.block_table("s"))
    kept = (blocks * full + max(held) * (layers - full)) * layer_block
    every = blocks * layers * layer_block
    assert kept <= every / 4, f"{kept / every:.3f} of every block's bytes"
    # While prefilling, a chunk's queries see the window before it and the chunk itself.
    assert during_prefill <= (window + 2048) // BS + 2
    bm.check_integrity()


def test_blocks_behind_the_window_idle_and_are_reused_when_slots_run_out():
    bm = manager(num_blocks=100, num_slots=9, window=32)  # 8 usable slots
    run(bm, "a", list(range(160)), chunk=16, upto=160)  # 10 blocks; at most 4 held
    assert bm.window is not None
    assert bm.window.num_held <= 4 and bm.window.num_available >= 4
    run(bm, "b", list(range(1000, 1160)), chunk=16, upto=160)  # takes idle slots of "a"
    bm.free("a")
    bm.free("b")
    bm.check_integrity()


def test_a_prefix_hit_stops_where_the_window_lost_its_slots():
    window = 32
    bm = manager(num_blocks=100, num_slots=30, window=window)
    shared = list(range(96))  # 6 full blocks
    run(bm, "a", shared + [500], chunk=200, upto=97)
    bm.free("a")  # every block cached, their slots idle
    hit = bm.find_prefix_hit(shared + [7, 8])
    assert hit is not None and len(hit.block_ids) == 6  # the window's blocks kept their slots
    # Other work takes every idle slot: the cached blocks keep their full layers' KV only.
    run(bm, "b", list(range(2000, 2000 + 29 * BS)), chunk=29 * BS, upto=29 * BS)
    assert bm.find_prefix_hit(shared + [7, 8]) is None
    bm.free("b")
    bm.check_integrity()


def test_a_hit_on_blocks_behind_the_window_needs_no_slot_for_them():
    """Only the blocks the first query after the hit sees need slots: a long cached prefix
    whose early blocks lost theirs is still a hit."""
    window = 32
    bm = manager(num_blocks=100, num_slots=30, window=window)
    prefix = list(range(160))  # 10 blocks
    run(bm, "a", prefix + [1], chunk=16, upto=161)  # early blocks go idle as "a" moves on
    assert bm.window is not None
    # Reuse idle slots of the earliest blocks only: "b" needs 2 blocks (2 slots).
    idle_before = bm.window.num_available
    run(bm, "b", list(range(3000, 3032)), chunk=32, upto=32)
    assert bm.window.num_available == idle_before - 2
    bm.free("a")
    hit = bm.find_prefix_hit(prefix + [9, 9])
    assert hit is not None and len(hit.block_ids) == 10
    assert bm.allocate("c", 162, hit, num_computed=160) is not None
    assert bm.window.num_held == 2 + 3  # "b": 2; "c": blocks 8, 9 and the new block 10
    bm.check_integrity()


def test_fork_copy_on_write_and_trim_keep_the_counts_exact():
    bm = manager(num_blocks=64, num_slots=20, window=32)
    run(bm, "p", list(range(40)), chunk=40, upto=40)  # last block partly filled
    bm.fork("p", "c")
    bm.check_integrity()
    alloc = bm.allocate("c", 41, num_computed=40)  # writes the shared last block: copy
    assert alloc is not None and len(alloc.copies) == 1
    bm.check_integrity()
    assert bm.allocate("p", 80, num_computed=40) is not None  # drafts, then rejected
    bm.trim("p", 41)
    bm.check_integrity()
    for seq_id in ("p", "c"):
        bm.free(seq_id)
    bm.check_integrity()
    assert bm.window is not None and bm.window.num_held == 0


def test_no_slot_left_means_no_allocation_and_nothing_changes():
    bm = manager(num_blocks=64, num_slots=4, window=64)  # 3 usable slots
    run(bm, "a", list(range(48)), chunk=48, upto=48)  # 3 blocks, all in the window
    assert not bm.can_allocate("b", 16)
    assert bm.allocate("b", 16, num_computed=0) is None
    assert not bm.has_seq("b")
    bm.check_integrity()


@pytest.mark.parametrize("window", [16, 512, 4096])
def test_the_slots_sized_for_a_batch_cover_every_sequences_window(window):
    """Steps as the scheduler makes them: every running sequence decodes one token, then one
    prompt takes the rest of the 256-token budget, until 8 sequences run."""
    budget, length = 256, window + 300
    needed = slots_needed(window, BS, max_num_seqs=8, max_batched=budget)
    bm = manager(num_blocks=10_000, num_slots=needed + 1, window=window)
    done: dict[int, int] = {}
    for _ in range(200):
        for i, n in done.items():
            if n >= length:
                assert bm.allocate(i, n + 1, num_computed=n) is not None
                done[i] = n + 1
        prefilling = [i for i, n in done.items() if n < length] or [len(done)]
        if prefilling[0] < 8:
            i = prefilling[0]
            n = done.get(i, 0)
            new = min(budget - len(done), length - n)
            assert bm.allocate(i, n + new, num_computed=n) is not None
            done[i] = n + new
    assert len(done) == 8
    bm.check_integrity()
