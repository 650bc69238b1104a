"""Greedy float32 outputs are token-identical to HF transformers, however the engine gets there:
plain batching, chunked prefill, prefix-cache hits, preemption, requests joining mid-decode."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from tests.engine.hf_oracle import hf_greedy, random_prompts

ARCHS = ["llama", "llama2", "mistral", "qwen2", "qwen3"]
LENGTHS = [1, 5, 16, 17, 40, 97, 180, 333, 64, 250]
MAX_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(llm: LLM, lengths: list[int] = LENGTHS, seed: int = 1) -> list[list[int]]:
    return random_prompts(lengths, llm.engine.model_config.vocab_size, seed)


def _assert_matches_hf(model_dir, prompts, outputs) -> None:
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), MAX_NEW), (
            f"prompt of {len(prompt)} tokens diverged from HF"
        )
        assert out.outputs[0].finish_reason == "length"


def _assert_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    usage = llm.engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_sequences == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_hf(tiny_models, arch):
    llm = LLM(tiny_models[arch])
    prompts = _prompts(llm)
    _assert_matches_hf(tiny_models[arch], prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    _assert_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_hf(tiny_models, arch):
    # A 24-token budget is far below most prompts, so prefills run in chunks beside decodes.
    llm = LLM(tiny_models[arch], max_num_batched_tokens=24)
    prompts = _prompts(llm)
    seen_partial = []
    engine = llm.engine
    original = engine.scheduler.schedule

    def spy():
        out = original()
        seen_partial.extend(s for s in out.scheduled if not s.samples)
        return out

    engine.scheduler.schedule = spy
    _assert_matches_hf(tiny_models[arch], prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert seen_partial, "no prefill was split into chunks"
    _assert_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_hf(tiny_models, arch):
    llm = LLM(tiny_models[arch])
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([70], vocab, seed=7)[0]
    suffixes = random_prompts([1, 9, 30, 2, 50, 13, 16, 4], vocab, seed=8)
    prompts = [shared + s for s in suffixes]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    _assert_matches_hf(tiny_models[arch], prompts, first + rest)
    bm = llm.engine.block_manager
    assert bm.prefix_cache_hits >= 7 * 64, "shared 70-token prefix should hit 4 blocks each"
    assert all(out.num_cached_tokens == 64 for out in rest)
    _assert_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_keeps_outputs_identical(tiny_models, arch):
    # 48 blocks * 16 slots hold ~770 tokens; the batch needs ~1400 with outputs.
    llm = LLM(tiny_models[arch], num_kv_blocks=48, enable_prefix_caching=False)
    prompts = _prompts(llm, [30, 120, 200, 90, 250, 60, 150, 110])
    _assert_matches_hf(tiny_models[arch], prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_added_while_others_decode(tiny_models, arch):
    engine = LLMEngine(tiny_models[arch], EngineConfig(max_num_batched_tokens=64))
    prompts = random_prompts(LENGTHS, engine.model_config.vocab_size)
    finished = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step
            i, prompt = pending.pop(0)
            engine.add_request(prompt, GREEDY, request_id=str(i))
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out
        step += 1
    outputs = [finished[i] for i in range(len(prompts))]
    _assert_matches_hf(tiny_models[arch], prompts, outputs)
    engine.check_integrity()


def test_sliding_window_matches_hf(tmp_path):
    from splitserve.testing.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", "mistral", config_overrides={"sliding_window": 12})
    llm = LLM(model_dir, max_num_batched_tokens=32)
    prompts = _prompts(llm, [5, 30, 70, 140])
    _assert_matches_hf(model_dir, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
