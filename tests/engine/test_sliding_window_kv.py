"""Sliding-window layers keep only the blocks their window covers (engine/window_slots.py) on
the offline engine, and it still gives HF transformers' greedy tokens: with slots so scarce
that sequences wait and recompute for them, with chunked prefill across the window, and with
prefix hits; the memory it saves becomes more blocks for the full layers."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.engine.hf_oracle import hf_greedy, random_prompts

STEPS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
WINDOWED = ("gemma3", "gpt_oss")  # the tiny families with sliding and full layers


def _held_slots(llm: LLM) -> list[int]:
    """Record the window slots held after every engine step."""
    engine, held = llm.engine, []
    step = engine.step

    def recorded():
        out = step()
        held.append(engine.kv_usage().num_window_slots_held)
        return out

    engine.step = recorded  # type: ignore[method-assign]
    return held


@pytest.mark.parametrize("family", WINDOWED)
def test_only_the_sliding_layers_move_to_a_window_pool(tiny_families, family):
    llm = LLM(tiny_families[family], num_kv_blocks=64)
    cache, cfg = llm.engine.kv_cache, llm.engine.model_config
    sliding = sum(cfg.window(i) is not None for i in range(cfg.num_layers))
    assert cache.window_pool is not None and cache.window_pool.shape[1] == sliding
    assert cache.pool.shape[1] == cfg.num_layers - sliding
    kept = LLM(tiny_families[family], num_kv_blocks=64, sliding_window_kv=False)
    assert kept.engine.kv_cache.window_pool is None
    assert kept.engine.kv_cache.pool.shape[1] == cfg.num_layers


def test_a_model_whose_every_layer_slides_keeps_one_pool(tiny_families):
    llm = LLM(tiny_families["mixtral"], num_kv_blocks=64)
    assert llm.engine.kv_cache.window_pool is None


@pytest.mark.parametrize("family", WINDOWED)
def test_scarce_window_slots_chunked_prefill_and_prefix_hits_match_hf(tiny_families, family):
    model_dir = tiny_families[family]
    # 9 usable slots: five sequences' windows do not all fit, so some wait (or are preempted
    # and recompute) for slots while the full layers' pool has room.
    llm = LLM(model_dir, num_kv_blocks=96, num_window_slots=10, max_num_batched_tokens=24)
    held = _held_slots(llm)
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([48], vocab, seed=11)[0]
    prompts = [shared + s for s in random_prompts([2, 40, 90, 17, 66], vocab, seed=12)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, first + rest, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), STEPS)
    assert any(out.num_cached_tokens > 0 for out in rest)  # a prefix hit through the window
    assert max(held) <= 9
    llm.engine.check_integrity()
    assert llm.engine.kv_usage().num_window_slots_held == 0


@pytest.mark.parametrize("family", WINDOWED)
def test_a_long_sequence_holds_only_its_window_while_it_decodes(tiny_families, family):
    model_dir = tiny_families[family]
    llm = LLM(model_dir, num_kv_blocks=64, max_num_batched_tokens=32)
    held = _held_slots(llm)
    prompt = random_prompts([200], llm.engine.model_config.vocab_size, seed=13)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), STEPS)
    window = llm.engine.model_config.sliding_window
    assert window is not None
    # Decoding: the window's blocks and the one being written; prefill chunks add theirs.
    decode = held[-STEPS + 1 :]
    assert max(decode) <= -(-(window - 1) // 16) + 2
    assert max(held) <= -(-(window - 1 + 32) // 16) + 2
    assert len(llm.engine.block_manager.pool.blocks) == 64


@pytest.mark.parametrize("family", WINDOWED)
def test_the_memory_the_window_saves_holds_more_blocks(tiny_families, family):
    budget = 8 << 20
    options = {"kv_cache_memory_bytes": budget, "max_num_seqs": 8, "max_model_len": 2048}
    llm = LLM(tiny_families[family], **options)
    kept = LLM(tiny_families[family], **options, sliding_window_kv=False)
    cache = llm.engine.kv_cache
    assert cache.window_pool is not None
    used = cache.pool.numel() * cache.pool.element_size()
    used += cache.window_pool.numel() * cache.window_pool.element_size()
    assert used <= budget
    assert llm.engine.config.num_kv_blocks > kept.engine.config.num_kv_blocks


def test_too_few_window_slots_for_one_chunk_is_refused_at_start(tiny_families):
    # Window 16 and 24-token chunks: a step of one sequence may see 3 blocks and write 2 more.
    with pytest.raises(ValueError, match="num_window_slots 4 cannot hold"):
        LLM(tiny_families["gemma3"], num_kv_blocks=64, num_window_slots=4,
            max_num_batched_tokens=24)  # fmt: skip
