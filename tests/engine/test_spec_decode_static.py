"""Speculative steps over static buffers (what a GPU replays as CUDA graphs, here run eagerly on
the CPU over the same padded layout) stay lossless: greedy float32 outputs equal HF's for the
draft model and n-gram proposers, with rows of different K (front-padded), batches padded to a
bucket, a draft that catches up on a prompt it never saw, and seeded sampling next to greedy."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.spec_decode.config import SpeculativeConfig
from splitserve.engine.spec_decode.graphs import DraftSteps, VerifySteps
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow


def _static(engine: LLMEngine) -> tuple[list[VerifySteps], list[DraftSteps]]:
    """Turn the engine's static speculative steps on (no capture: the CPU runs them eagerly)
    and count their runs."""
    assert engine.speculator is not None
    engine.speculator.use_static_steps(engine.runner, capture=False)
    verify = list(engine.runner.verify_steps.values())
    draft = list(getattr(engine.speculator.proposer, "_static", {}).values())
    for steps in [*verify, *draft]:
        steps.num_runs = 0  # type: ignore[attr-defined]
        upload = steps.upload

        def counted(bucket: int, steps=steps, upload=upload) -> None:  # type: ignore[no-untyped-def]
            steps.num_runs += 1
            upload(bucket)

        steps.upload = counted  # type: ignore[method-assign]
    return verify, draft


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _assert_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    usage = engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_sequences == 0


def test_static_truncated_draft_matches_hf_with_mixed_k_and_prefix_hits(tiny_models):
    model_dir = tiny_models["llama"]
    # NOTE: no acceptance backoff: this 1-layer draft is rarely right, and every step should
    # still speculate here.
    spec = SpeculativeConfig("draft", 4, draft_layers=1, min_accepted=0)
    llm = LLM(model_dir, speculative=spec, max_num_batched_tokens=24)
    verify, draft = _static(llm.engine)
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([40], vocab, seed=41)[0]
    prompts = [shared + s for s in random_prompts([5, 23, 11], vocab, seed=42)]
    # max_tokens 6 and 9 cap K near the end (rows of fewer drafts, front-padded); three rows
    # pad to a bucket of 4. The second call's prompts hit the prefix cache: the draft never saw
    # those blocks and catches up.
    lens = [16, 6, 9]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], _greedy(16), use_tqdm=False)]
    out = llm.generate(prompts[1:], [_greedy(n) for n in lens[1:]], use_tqdm=False)
    got += [o.outputs[0].token_ids for o in out]
    assert got == [hf_greedy(model_dir, tuple(p), n) for p, n in zip(prompts, lens, strict=True)]
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert llm.engine.block_manager.prefix_cache_hits >= 32
    assert sum(s.num_runs for s in verify) > 0 and sum(s.num_runs for s in draft) > 0
    _assert_clean(llm.engine)


def test_static_draft_equal_to_the_target_accepts_everything(tiny_models):
    # Any slip in the padded layout (a shifted position, a missed slot, a wrong row read back)
    # makes the target's own weights disagree with themselves somewhere.
    model_dir = tiny_models["qwen2"]
    llm = LLM(model_dir, speculative=SpeculativeConfig("draft", 3, model=str(model_dir)))
    verify, draft = _static(llm.engine)
    prompts = random_prompts([9, 30, 17], llm.engine.model_config.vocab_size, seed=43)
    lens = [12, 7, 10]
    out = llm.generate(prompts, [_greedy(n) for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [
        hf_greedy(model_dir, tuple(p), n) for p, n in zip(prompts, lens, strict=True)
    ]
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert sum(s.num_runs for s in verify) > 0 and sum(s.num_runs for s in draft) > 0
    _assert_clean(llm.engine)


def test_static_draft_on_a_decode_engine_catches_up_on_the_prompt(tiny_models):
    from tests.engine.test_kv_connector import _prefill_elsewhere

    model_dir = tiny_models["llama"]
    prefill = LLMEngine(model_dir, EngineConfig())
    spec = SpeculativeConfig("draft", 3, model=str(model_dir))
    decode = LLMEngine(model_dir, EngineConfig(speculative=spec))
    _, draft = _static(decode)
    prompt = random_prompts([45], prefill.model_config.vocab_size, seed=44)[0]
    first, data = _prefill_elsewhere(prefill, prompt, "r")
    decode.kv_connector.write_blocks(decode.reserve("r", prompt, _greedy(8)).block_ids, data)
    outputs = decode.admit("r", _greedy(8), first)
    while decode.has_unfinished_requests():
        outputs = decode.step()
    assert outputs[-1].outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 8)
    stats = decode.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert sum(s.num_runs for s in draft) > 0
    _assert_clean(decode)


def test_static_ngram_verification_matches_hf_next_to_seeded_sampling(tiny_models):
    model_dir = tiny_models["llama"]
    spec = SpeculativeConfig("ngram", 4, min_accepted=0)  # every step speculates
    llm = LLM(model_dir, speculative=spec)
    verify, _ = _static(llm.engine)
    vocab = llm.engine.model_config.vocab_size
    spans = random_prompts([9, 20], vocab, seed=45)
    prompts = [s * 3 for s in spans] + random_prompts([14], vocab, seed=46)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=7, ignore_eos=True)
    params = [_greedy(20), _greedy(11), seeded]
    out = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in out]
    hf = [hf_greedy(model_dir, tuple(p), n) for p, n in zip(prompts[:2], [20, 11], strict=True)]
    assert got[:2] == hf
    # The seeded row draws the same tokens as the eager speculative engine: same logits.
    eager = LLM(model_dir, speculative=spec).generate(prompts, params, use_tqdm=False)
    assert got[2] == eager[2].outputs[0].token_ids
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert sum(s.num_runs for s in verify) > 0
    _assert_clean(llm.engine)
