"""Draft-model speculation is lossless: greedy float32 outputs equal HF's, whether the draft is
a separate checkpoint (here the target's own, which must accept every draft) or the target's
first layers (which must reject some), through chunked prefill, prefix hits and preemption; the
draft's KV pool mirrors the target's blocks and shares its memory budget."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.spec_decode.config import SpeculativeConfig
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _assert_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    usage = llm.engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_sequences == 0


def test_truncated_draft_matches_hf_through_chunked_prefill_and_prefix_hits(tiny_models):
    model_dir = tiny_models["llama"]
    spec = SpeculativeConfig("draft", 3, draft_layers=1)
    llm = LLM(model_dir, speculative=spec, max_num_batched_tokens=20)
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([40], vocab, seed=31)[0]
    prompts = [shared + s for s in random_prompts([5, 23], vocab, seed=32)]
    got = _generate(llm, prompts[:1]) + _generate(llm, prompts[1:])
    assert got == [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # rejections
    assert llm.engine.block_manager.prefix_cache_hits >= 32
    _assert_clean(llm)


def test_draft_checkpoint_equal_to_the_target_accepts_everything(tiny_models):
    model_dir = tiny_models["qwen2"]
    llm = LLM(model_dir, speculative=SpeculativeConfig("draft", 4, model=str(model_dir)))
    plain_blocks = LLM(model_dir).engine.config.num_kv_blocks
    assert llm.engine.config.num_kv_blocks == plain_blocks // 2  # same shape: half each
    prompts = random_prompts([9, 30], llm.engine.model_config.vocab_size, seed=33)
    assert _generate(llm, prompts) == [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    _assert_clean(llm)


def test_draft_checkpoint_catches_up_on_prefix_hits_and_accepts_everything(tiny_models):
    model_dir = tiny_models["llama"]
    # The draft is the target itself: it must accept every draft, so the KV of the prefix it
    # caught up on (the target's came from the prefix cache) must be right.
    spec = SpeculativeConfig("draft", 3, model=str(model_dir), draft_catch_up_tokens=4)
    llm = LLM(model_dir, speculative=spec, max_num_batched_tokens=20)
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([40], vocab, seed=39)[0]
    prompts = [shared + s for s in random_prompts([5, 23], vocab, seed=40)]
    got = _generate(llm, prompts[:1]) + _generate(llm, prompts[1:])
    assert got == [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    assert llm.engine.block_manager.prefix_cache_hits >= 32
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    _assert_clean(llm)


def test_truncated_draft_under_preemption_matches_hf(tiny_models):
    model_dir = tiny_models["llama"]
    spec = SpeculativeConfig("draft", 3, draft_layers=1)
    llm = LLM(model_dir, speculative=spec, num_kv_blocks=8)
    prompts = random_prompts([30, 45, 20, 38], llm.engine.model_config.vocab_size, seed=34)
    assert _generate(llm, prompts) == [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().spec_decode_num_drafts > 0
    _assert_clean(llm)


def test_draft_on_a_decode_engine_computes_the_prompt_kv_after_admission(tiny_models):
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig
    from tests.engine.test_kv_connector import _prefill_elsewhere

    model_dir = tiny_models["llama"]
    prefill = LLMEngine(model_dir, EngineConfig())
    # The draft is the target itself: every draft is accepted only if its prompt KV, which the
    # prefill worker never sent, was computed here after admission.
    spec = SpeculativeConfig("draft", 3, model=str(model_dir))
    decode = LLMEngine(model_dir, EngineConfig(speculative=spec))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = random_prompts([45], prefill.model_config.vocab_size, seed=35)[0]
    first, data = _prefill_elsewhere(prefill, prompt, "r")
    decode.kv_connector.write_blocks(decode.reserve("r", prompt, params).block_ids, data)
    outputs = decode.admit("r", params, first)
    while decode.has_unfinished_requests():
        outputs = decode.step()
    assert outputs[-1].outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 8)
    stats = decode.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_draft_checkpoint_catches_up_on_an_admitted_prompt_in_chunks_decoding_plainly_meanwhile(
    tiny_models, async_scheduling
):
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig
    from tests.engine.test_kv_connector import _prefill_elsewhere

    model_dir = tiny_models["llama"]
    prefill = LLMEngine(model_dir, EngineConfig())
    # The draft is the target itself: every draft is accepted only if the prompt KV it caught
    # up on in chunks is right.
    spec = SpeculativeConfig("draft", 3, model=str(model_dir), draft_catch_up_tokens=8)
    # NOTE: with async scheduling the plain steps are not overlapped while the draft catches
    # up (an overlapped step is not observed: the draft would never catch up).
    config = EngineConfig(speculative=spec, async_scheduling=async_scheduling)
    decode = LLMEngine(model_dir, config)
    proposer = decode.speculator.proposer
    forward = proposer._forward
    widths: list[int] = []

    def counted(rows, want_logits):  # type: ignore[no-untyped-def]
        widths.append(sum(len(tokens) for _, tokens, _, _ in rows))
        return forward(rows, want_logits)

    proposer._forward = counted
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = random_prompts([45], prefill.model_config.vocab_size, seed=38)[0]
    first, data = _prefill_elsewhere(prefill, prompt, "r")
    decode.kv_connector.write_blocks(decode.reserve("r", prompt, params).block_ids, data)
    outputs = decode.admit("r", params, first)
    num_plain_steps = 0
    while decode.has_unfinished_requests():
        outputs = decode.step()
        if decode.stats().spec_decode_num_drafts == 0:
            num_plain_steps += 1
    assert outputs[-1].outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 16)
    # No forward over the whole prompt: chunks of at most 8 (the last with the newest token).
    assert widths and max(widths) <= 8 + 1
    # 8 a step while the target adds 1: 45 prompt tokens take 7 plain steps, then it speculates
    # (with async scheduling, two turns more: the admission step, overlapped before the
    # sequence was running, and the turn that hands out the step in flight before the first
    # speculative one runs).
    assert num_plain_steps == 7 + 2 * async_scheduling
    stats = decode.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert stats.num_free_blocks == stats.num_total_blocks


def test_truncated_draft_shares_the_target_pool_and_catches_up_nothing_after_admission(
    tiny_models,
):
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig
    from tests.engine.test_kv_connector import _prefill_elsewhere

    model_dir = tiny_models["llama"]
    prefill = LLMEngine(model_dir, EngineConfig())
    spec = SpeculativeConfig("draft", 3, draft_layers=1, min_accepted=0)
    decode = LLMEngine(model_dir, EngineConfig(speculative=spec))
    assert decode.config.num_kv_blocks == prefill.config.num_kv_blocks  # no pool of its own
    proposer = decode.speculator.proposer
    assert proposer._kv_layers[0].data_ptr() == decode.kv_cache.layers[0].data_ptr()
    widths: list[int] = []
    forward = proposer._forward

    def counted(rows, want_logits):  # type: ignore[no-untyped-def]
        widths.extend(len(tokens) for _, tokens, _, _ in rows)
        return forward(rows, want_logits)

    proposer._forward = counted
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = random_prompts([45], prefill.model_config.vocab_size, seed=36)[0]
    first, data = _prefill_elsewhere(prefill, prompt, "r")
    decode.kv_connector.write_blocks(decode.reserve("r", prompt, params).block_ids, data)
    outputs = decode.admit("r", params, first)
    while decode.has_unfinished_requests():
        outputs = decode.step()
    assert outputs[-1].outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 10)
    assert decode.stats().spec_decode_num_drafts > 0
    # The draft ran only on the newest token and its own drafts: never on the prompt.
    assert widths and max(widths) == 1
    assert decode.stats().num_free_blocks == decode.stats().num_total_blocks


def test_a_truncated_draft_keeps_nothing_for_finished_requests(tiny_models):
    llm = LLM(tiny_models["llama"], speculative=SpeculativeConfig("draft", 3, draft_layers=1))
    prompts = random_prompts([9, 14, 20], llm.engine.model_config.vocab_size, seed=37)
    _generate(llm, prompts[:2])
    _generate(llm, prompts[2:])  # a step after the first ones finished forgets them
    assert len(llm.engine.speculator.proposer._valid) <= 1
