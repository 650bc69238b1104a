"""Greedy float32 outputs of the Mixture-of-Experts and mixed-attention families (Qwen3-MoE,
Mixtral, gpt-oss, Gemma 3) are token-identical to HF transformers over 64 steps: plain batches,
chunked prefill beside decodes, prefix-cache hits, preemption."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.spec_decode.config import SpeculativeConfig
from splitserve.testing.tiny_families import TINY_FAMILIES
from tests.engine.hf_oracle import assert_engine_clean, assert_matches_hf, random_prompts

STEPS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
# Past the tiny models' sliding windows (16 and 48 tokens) and across block edges.
LENGTHS = [1, 7, 16, 17, 50, 130]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_batch_and_chunked_prefill_match_hf(tiny_families, family):
    model_dir = tiny_families[family]
    whole, chunked = LLM(model_dir), LLM(model_dir, max_num_batched_tokens=24)
    prompts = random_prompts(LENGTHS, whole.engine.model_config.vocab_size)
    assert_matches_hf(model_dir, prompts, whole.generate(prompts, GREEDY, use_tqdm=False), STEPS)
    assert_matches_hf(model_dir, prompts, chunked.generate(prompts, GREEDY, use_tqdm=False), STEPS)
    assert_engine_clean(whole)
    assert_engine_clean(chunked)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prefix_hits_and_preemption_match_hf(tiny_families, family):
    model_dir = tiny_families[family]
    llm = LLM(model_dir, num_kv_blocks=24)
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([40], vocab, seed=7)[0]
    prompts = [shared + s for s in random_prompts([3, 21, 60, 9, 33], vocab, seed=8)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert_matches_hf(model_dir, prompts, first + rest, STEPS)
    assert all(out.num_cached_tokens == 32 for out in rest)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_engine_clean(llm)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_ngram_speculation_matches_hf(tiny_families, family):
    model_dir = tiny_families[family]
    llm = LLM(model_dir, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))
    spans = random_prompts([9, 20], llm.engine.model_config.vocab_size, seed=3)
    prompts = [s * 3 for s in spans]  # repeats, so n-gram drafts get proposed
    assert_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), STEPS)
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0
    assert_engine_clean(llm)
