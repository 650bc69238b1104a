"""A sample resumed on another engine from its prompt plus the tokens it had generated (what a
decode worker does when another one died mid-stream) goes on exactly as the first engine would
have: same tokens, text and stop, whatever the sampling (seeded draws, penalties, min_tokens,
logprobs)."""

from __future__ import annotations

import pytest

from splitserve.engine import LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.errors import InvalidRequest
from splitserve.engine.outputs import CompletionOutput, Resume
from tests.engine.hf_oracle import random_prompts

CASES = {
    "greedy_penalties": SamplingParams(
        temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.8,
        presence_penalty=0.5, min_tokens=6, ignore_eos=True,
    ),
    "seeded": SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=12, logprobs=2),
    "seeded_penalties": SamplingParams(
        temperature=1.2, seed=7, max_tokens=12, frequency_penalty=1.5, presence_penalty=1.0,
        min_tokens=8,
    ),
}  # fmt: skip


def _run(engine: LLMEngine, request_id: str) -> CompletionOutput:
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_resumed_sample_goes_on_as_the_first_engine_would_have(tiny_models, name):
    params = CASES[name]
    engine = LLMEngine(tiny_models["llama"], EngineConfig(block_size=16, num_kv_blocks=64))
    prompt = random_prompts([37], 500, seed=3)[0]
    engine.add_request(prompt, params, "whole")
    whole = _run(engine, "whole")
    assert len(whole.token_ids) > 6
    for cut in (1, 5, len(whole.token_ids) - 1):
        rid = f"resumed-{cut}"
        engine.reserve(rid, prompt, params, Resume(0, tuple(whole.token_ids[:cut])))
        engine.admit(rid, params, None)
        resumed = _run(engine, rid)
        assert resumed.token_ids == whole.token_ids, cut
        assert resumed.text == whole.text
        assert resumed.finish_reason == whole.finish_reason
        if params.logprobs is not None:
            assert resumed.logprobs is not None and whole.logprobs is not None
            for got, want in zip(resumed.logprobs[cut:], whole.logprobs[cut:], strict=True):
                assert got.keys() == want.keys()
                assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_a_resume_past_max_tokens_is_refused(tiny_models):
    engine = LLMEngine(tiny_models["llama"], EngineConfig(block_size=16, num_kv_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        engine.reserve("r", [5, 6, 7], params, Resume(0, (1, 2, 3, 4)))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.reserve("r", [5, 6, 7], params, Resume(0, (10**6,)))
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
