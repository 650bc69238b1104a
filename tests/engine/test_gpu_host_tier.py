"""On a GPU: the host-memory KV tier's copies (pinned memory, saves on a side stream, loads on
the compute stream before the step that reads them, CUDA graphs and overlapped steps on) give
HF's float32 greedy tokens through forced evict/restore and swap cycles, and the same tokens
as the engine without the tier. Skipped without CUDA (CI has none): `bench/device.sh
host-tier` runs it with bench/host_tier.py."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
TIER = 4 << 20


def _llm(model_dir, tier: int | None, num_kv_blocks: int) -> LLM:
    return LLM(
        model_dir, dtype="float32", device="cuda", num_kv_blocks=num_kv_blocks,
        kv_host_cache_bytes=tier,
    )  # fmt: skip


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_gpu_an_evicted_prefix_comes_back_from_pinned_memory_with_hfs_tokens(tiny_models):
    model = tiny_models["llama"]
    llm = _llm(model, TIER, num_kv_blocks=24)
    assert llm.engine.host_tier is not None and llm.engine.host_tier.blocks.is_pinned()
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([160], vocab, seed=21)[0]
    others = random_prompts([200, 200], vocab, seed=22)
    for round_ in range(3):  # evict, restore, evict again
        _tokens(llm, [shared + [5 + round_]])
        _tokens(llm, others[:1])
        _tokens(llm, others[1:])
        hit = llm.engine.block_manager.find_prefix_hit(shared + [9])
        assert hit is not None and not hit.block_ids and len(hit.host_blocks) == 10
        again = shared + [9 + round_]
        before = llm.engine.stats()
        assert _tokens(llm, [again]) == [hf_greedy(model, tuple(again), STEPS)]
        after = llm.engine.stats()
        assert after.num_prefill_tokens - before.num_prefill_tokens == 1
    llm.engine.check_integrity()


def test_gpu_preempted_sequences_swap_back_in_with_the_same_tokens_as_without_the_tier(
    tiny_models,
):
    model = tiny_models["llama"]
    prompts = random_prompts([60, 70, 80, 50, 90, 40], 500, seed=23)
    got, recomputed = {}, {}
    for tier in (None, TIER):
        llm = _llm(model, tier, num_kv_blocks=24)
        got[tier] = _tokens(llm, prompts)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        recomputed[tier] = stats.num_prefill_tokens - sum(map(len, prompts))
        recomputed[tier] -= stats.num_preemptions
        llm.engine.check_integrity()
    assert got[TIER] == got[None]
    assert got[TIER] == [hf_greedy(model, tuple(p), STEPS) for p in prompts]
    assert recomputed[TIER] == 0 < recomputed[None]
