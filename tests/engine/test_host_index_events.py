"""The host tier's prefix events (engine/host_index.py): what a worker publishes of its host tier
into the registry's prefix index, beside its GPU prefix cache's. Full blocks placed and evicted
are recorded; a swapped-out partly filled block never is (no other prompt can match it)."""

from __future__ import annotations

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.host_index import GPU_TIER, HOST_TIER, HostIndex, partial_key
from splitserve.engine.prefix_hash import chain_hash, prefix_block_hashes
from tests.engine.hf_oracle import random_prompts

TIER = 4 << 20  # bytes of host tier: room for every block these tests compute


def test_nothing_is_recorded_unless_asked():
    index = HostIndex(1)
    index.place(b"a", [1])
    index.drain()
    index.place(b"b", [2])  # evicts "a"
    assert index.drain_events() == []


def test_placed_and_evicted_full_blocks_are_recorded_in_order_and_drained_once():
    index = HostIndex(2)
    index.record_events()
    a, b, c = (chain_hash(None, [t]) for t in (1, 2, 3))
    index.place(a, [1])
    index.place(b, [2])
    index.drain()
    index.place(c, [3])  # evicts "a", the least recently used
    assert index.drain_events() == [(True, a), (True, b), (False, a), (True, c)]
    assert index.drain_events() == []


def test_a_swapped_out_partial_block_is_never_recorded_placed_or_evicted():
    index = HostIndex(1)
    index.record_events()
    full = chain_hash(None, [1, 2])
    partial = partial_key(full, [3])
    assert partial != full and len(partial) != len(full)
    index.place(partial, [3])
    index.drain()
    index.place(full, [1, 2])  # evicts the partial block: not published, so no removal
    assert index.drain_events() == [(True, full)]
    index.drain()
    index.place(partial_key(full, [4]), [4])  # evicts the full one: its removal is
    assert index.drain_events() == [(False, full)]


def test_the_engine_reports_both_tiers_events_apart(tiny_models):
    llm = LLM(
        tiny_models["llama"], num_kv_blocks=24, kv_host_cache_bytes=TIER,
        record_prefix_events=True,
    )  # fmt: skip
    prompt = random_prompts([81], llm.engine.model_config.vocab_size, seed=5)[0]  # 5 blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)
    events = llm.engine.take_prefix_events()
    hashes = prefix_block_hashes(prompt, llm.engine.config.block_size)
    assert [(a, h) for a, h, tier in events if tier == GPU_TIER] == [(True, h) for h in hashes]
    assert [(a, h) for a, h, tier in events if tier == HOST_TIER] == [(True, h) for h in hashes]
    assert llm.engine.take_prefix_events() == []
