"""The host-memory KV tier (engine/host_tier.py): blocks evicted from the GPU prefix cache come
back from host memory instead of being recomputed, preempted sequences swap out and back in,
and greedy tokens stay HF transformers' with the tier on, through forced evict/restore and
swap cycles."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.host_index import HostIndex, contiguous_runs
from splitserve.engine.host_tier import host_tier_slots
from tests.engine.hf_oracle import hf_greedy, random_prompts

STEPS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
TIER = 4 << 20  # bytes of host tier: room for every block these tests compute


def _outputs(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def test_an_evicted_prefix_comes_back_from_host_memory(tiny_models):
    model = tiny_models["llama"]
    llm = LLM(model, num_kv_blocks=24, kv_host_cache_bytes=TIER)
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([160], vocab, seed=21)[0]  # 10 blocks
    first = shared + [5]
    assert _outputs(llm, [first]) == [hf_greedy(model, tuple(first), STEPS)]
    # Other prompts take every block of the 24-block pool: the shared prefix leaves the GPU.
    others = random_prompts([200, 200], vocab, seed=22)
    _outputs(llm, others[:1])
    _outputs(llm, others[1:])
    engine = llm.engine
    assert engine.block_manager.find_prefix_hit(shared + [6]) is not None
    hit = engine.block_manager.find_prefix_hit(shared + [6])
    assert hit is not None and not hit.block_ids and len(hit.host_blocks) == 10
    again = shared + [6]
    before = engine.stats()
    works = []
    run = engine.host_tier.run
    engine.host_tier.run = lambda work: (works.append(work), run(work))[1]
    out = llm.generate([again], GREEDY, use_tqdm=False)[0]
    loads = [pair for work in works for pair in work.loads]
    assert len(loads) == 10 and len(contiguous_runs(loads)) <= 2  # new blocks in order
    assert out.outputs[0].token_ids == hf_greedy(model, tuple(again), STEPS)
    assert out.num_cached_tokens == 160
    after = engine.stats()
    assert after.num_prefill_tokens - before.num_prefill_tokens == 1  # only the new token
    assert after.host_cache_hits - before.host_cache_hits >= 10
    block_bytes = engine.kv_cache.block_bytes
    assert after.host_cache_bytes_loaded - before.host_cache_bytes_loaded == 10 * block_bytes
    assert after.host_cache_bytes_saved > 0
    engine.check_integrity()


@pytest.mark.parametrize("tier", [None, TIER])
def test_preemption_with_and_without_the_tier_gives_hfs_tokens(tiny_models, tier):
    model = tiny_models["llama"]
    llm = LLM(model, num_kv_blocks=20, kv_host_cache_bytes=tier)
    prompts = random_prompts([60, 70, 80, 50], llm.engine.model_config.vocab_size, seed=23)
    got = _outputs(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(model, tuple(prompt), STEPS)
    llm.engine.check_integrity()


def test_preempted_sequences_swap_back_in_without_recomputing(tiny_models):
    """Their full blocks were saved when hashed and their partly filled last block when they
    were preempted: rescheduled, each computes only the token it would have decoded anyway."""
    model = tiny_models["llama"]
    prompts = random_prompts([60, 70, 80, 50], 500, seed=23)
    recomputed = {}
    for tier in (None, TIER):
        llm = LLM(model, num_kv_blocks=20, kv_host_cache_bytes=tier)
        _outputs(llm, prompts)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        # NOTE: a resumed sequence's one new token counts as a prefill token
        recomputed[tier] = stats.num_prefill_tokens - sum(map(len, prompts))
        recomputed[tier] -= stats.num_preemptions
        llm.engine.check_integrity()
    assert recomputed[TIER] == 0
    assert recomputed[None] > 0


def test_a_small_tier_evicts_least_recently_used_first_but_never_a_slot_about_to_load():
    index = HostIndex(2)
    a = index.place(b"a", [1])
    index.place(b"b", [2])
    index.drain()
    assert index.lookup(b"a", [1]) == a  # "a" now the most recently used
    index.place(b"c", [3])  # evicts "b"
    assert b"b" not in index and b"a" in index and b"c" in index
    assert index.lookup(b"c", [4]) is None  # same hash, other tokens: no hit
    assert index.lookup(b"c", [3]) is not None
    assert index.place(b"d", [5]) is None  # "a" and "c" are about to be read: no room
    index.drain()
    assert index.place(b"d", [5]) is not None


def test_a_tier_larger_than_the_host_is_refused_clearly():
    with pytest.raises(ValueError, match="GiB available on this host"):
        host_tier_slots(1 << 50, 1 << 20)
    with pytest.raises(ValueError, match="hold no block"):
        host_tier_slots(100, 1 << 20)


def test_the_tier_and_a_window_pool_are_refused_together(tiny_families):
    with pytest.raises(ValueError, match="window pool"):
        LLM(tiny_families["gemma3"], num_kv_blocks=64, kv_host_cache_bytes=TIER)
    llm = LLM(
        tiny_families["gemma3"], num_kv_blocks=64, kv_host_cache_bytes=TIER,
        sliding_window_kv=False,
    )  # fmt: skip
    assert llm.engine.host_tier is not None


def test_consecutive_blocks_copy_as_one_run():
    assert contiguous_runs([]) == []
    assert contiguous_runs([(4, 10), (5, 11), (6, 12), (9, 13), (10, 14), (3, 2)]) == [
        (4, 10, 3),
        (9, 13, 2),
        (3, 2, 1),
    ]
    assert contiguous_runs([(5, 1), (4, 2)]) == [(5, 1, 1), (4, 2, 1)]  # one steps down
