"""The gateway's in-memory prefix index (gateway/prefix_view.py) answers as the registry's Lua
lookup does (`Registry.prefix_match_tiers`, a real redis-server) on the same index, hashes a
prompt exactly as `prefix_block_hashes` but only as far as a run goes, and costs a fixed figure
of memory per resident block, all of it given back when the blocks leave."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from splitserve.engine.prefix_hash import adapter_root, prefix_block_hashes
from splitserve.gateway.prefix_view import PrefixView
from splitserve.gateway.prompt_chain import ChainMemo, PromptChain
from splitserve.kv_transfer.registry import Registry

BS = 4
# Python memory one resident block costs the view, held by one index id: its hash (a 16-byte
# bytes object), the dict entry mapping it to its holders' bits, and the entry in that id's
# set. Measured 187 bytes at 20,000 blocks, 143 at 50,000 (2026-12-07, CPython 3.11: the dict's
# and sets' growth steps). A further holder of the same block costs its set entry and its own
# copy of the hash: measured 154 and 91.
BYTES_PER_BLOCK = 250
BYTES_PER_HOLDER = 200


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


@pytest.mark.parametrize("length", [0, 1, 4, 5, 8, 9, 63, 64, 65, 1000, 4097])
def test_the_chain_is_prefix_block_hashes_whatever_the_length(length: int) -> None:
    tokens = prompt(random.Random(length), length)
    assert PromptChain(tokens, BS).all() == prefix_block_hashes(tokens, BS)
    root = adapter_root("a", "d")
    assert PromptChain(tokens, 16, root).all() == prefix_block_hashes(tokens, 16, root)


def test_the_memo_gives_the_same_digests_and_spares_the_hashing() -> None:
    rng = random.Random(5)
    memo = ChainMemo(segments=40)
    bases = [prompt(rng, rng.randrange(1, 3000)) for _ in range(6)]
    for _ in range(200):
        base = rng.choice(bases)
        tokens = base[: rng.randrange(len(base) + 1)] + prompt(rng, rng.randrange(0, 500))
        bs = rng.choice((4, 16))
        root = rng.choice((None, adapter_root("a", "d")))
        got = PromptChain(tokens, bs, root, memo).all()
        assert got == prefix_block_hashes(tokens, bs, root)
        assert len(memo) <= 40
    # A prompt routed again, and a longer turn of it, reuse its hashes (least recently used
    # segments go first: a 2,000-block prompt's 32 segments fit)
    tokens = prompt(rng, 2000 * 16)
    first = PromptChain(tokens, 16, memo=memo)
    first.all()
    hashed = memo.hashed
    again = PromptChain(tokens, 16, memo=memo).all()
    assert memo.hashed == hashed and again == first.hashes
    longer = tokens + prompt(rng, 300)
    assert PromptChain(longer, 16, memo=memo).all() == prefix_block_hashes(longer, 16)
    assert memo.hashed - hashed <= 20 + 64  # its new blocks, and the last segment's again


def fill(registry: Registry, view: PrefixView, index_id: str, hashes: list[bytes]) -> None:
    if hashes:
        registry.add_prefix_blocks(index_id, hashes)
        view.add(index_id, hashes)


def test_the_view_matches_the_registrys_lookup_on_random_indexes(registry: Registry) -> None:
    rng = random.Random(7)
    memo = ChainMemo(segments=3)  # NOTE: small: segments come and go
    for trial in range(30):
        registry._client.flushdb()
        view = PrefixView()
        bases = [prompt(rng, rng.randrange(1, 600)) for _ in range(4)]
        holes = rng.choice((0.0, 0.02, 0.15))
        for w in range(rng.randrange(1, 6)):
            for tier in (f"w{w}", f"w{w}@host"):
                for base in rng.sample(bases, rng.randrange(0, 3)):
                    hashes = prefix_block_hashes(base, BS)
                    # a run with holes: some blocks evicted from this tier
                    held = [
                        h for h in hashes[: rng.randrange(len(hashes) + 1)] if rng.random() >= holes
                    ]
                    fill(registry, view, tier, held)
            if rng.random() < 0.3:  # evictions after the fact
                tier = rng.choice((f"w{w}", f"w{w}@host"))
                gone = [h for h in prefix_block_hashes(rng.choice(bases), BS) if rng.random() < 0.3]
                registry.remove_prefix_blocks(tier, gone)
                view.remove(tier, gone)
        if trial % 5 == 0:  # a cleared worker (it left, restarted or died)
            registry.clear_prefix_blocks("w0")
            view.clear("w0")
        for _ in range(20):
            base = rng.choice(bases)
            cut = rng.randrange(len(base) + 1)
            tokens = base[:cut] + prompt(rng, rng.randrange(0, 40))
            want = registry.prefix_match_tiers(prefix_block_hashes(tokens, BS))
            assert view.match(PromptChain(tokens, BS)) == want, (trial, cut)
            assert view.match(PromptChain(tokens, BS, memo=memo)) == want, (trial, cut)


def test_a_miss_hashes_one_block_and_a_hit_about_its_own_length(registry: Registry) -> None:
    rng = random.Random(1)
    held = prompt(rng, 4000)
    view = PrefixView()
    view.add("d0", prefix_block_hashes(held, BS)[:300])
    view.add("d1@host", prefix_block_hashes(held, BS)[:200])
    miss = PromptChain(prompt(rng, 4000), BS)
    assert view.match(miss) == {}
    assert len(miss.hashes) == 1
    hit = PromptChain(held, BS)
    assert view.match(hit) == {"d0": (300, 300), "d1": (0, 200)}
    assert 301 <= len(hit.hashes) <= 301 + 64


def test_only_live_workers_count(registry: Registry) -> None:
    tokens = prompt(random.Random(2), 100)
    hashes = prefix_block_hashes(tokens, BS)
    view = PrefixView()
    view.add("a", hashes[:10])
    view.add("b@host", hashes[:5])
    view.set_live(["b"])
    assert view.match(PromptChain(tokens, BS)) == {"b": (0, 5)}
    view.set_live([])
    chain = PromptChain(tokens, BS)
    assert view.match(chain) == {}
    assert len(chain.hashes) == 1  # nobody live holds the first block: no further hashing
    view.set_live(None)
    view.add("c", hashes[:3])  # a slot taken after the live set was given counts too
    assert view.match(PromptChain(tokens, BS)) == {"a": (10, 10), "b": (0, 5), "c": (3, 3)}


def test_a_cleared_workers_slot_is_reused_without_its_blocks() -> None:
    tokens = prompt(random.Random(3), 100)
    hashes = prefix_block_hashes(tokens, BS)
    view = PrefixView()
    view.add("a", hashes[:10])
    view.add("a@host", hashes[:20])
    view.clear("a")
    assert view.entries() == {}
    view.add("b", hashes[:2])  # takes a's slot: none of a's bits may be left
    assert view.match(PromptChain(tokens, BS)) == {"b": (2, 2)}
    view.remove("b", hashes[:2])
    assert view.match(PromptChain(tokens, BS)) == {}
    assert view.entries() == {}


def copies(hashes: list[bytes]) -> list[bytes]:
    return [bytes(bytearray(h)) for h in hashes]


def test_the_view_costs_a_fixed_figure_per_resident_block_and_gives_it_back() -> None:
    blocks = 20_000
    first = prefix_block_hashes(list(range(blocks * BS + 1)), BS)
    second = prefix_block_hashes(list(range(1, blocks * BS + 2)), BS)
    view = PrefixView()
    view.add("warm", first[:1])
    view.clear("warm")
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        # NOTE: the hashes as the follower gets them: fresh objects, owned by the view
        view.add("d0", copies(first))
        view.add("p0", copies(second))
        per_block = (tracemalloc.get_traced_memory()[0] - base) / (2 * blocks)
        assert per_block <= BYTES_PER_BLOCK, f"{per_block:.0f} bytes per block"
        shared = tracemalloc.get_traced_memory()[0]
        view.add("d0@host", copies(first))  # a second holder of the same blocks
        per_holder = (tracemalloc.get_traced_memory()[0] - shared) / blocks
        assert per_holder <= BYTES_PER_HOLDER, f"{per_holder:.0f} bytes per further holder"
        view.clear("d0")
        view.remove("p0", second)
        assert view.entries() == {}
        assert tracemalloc.get_traced_memory()[0] - base < 0.05 * blocks * per_block
    finally:
        tracemalloc.stop()
