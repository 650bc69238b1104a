"""A sample whose KV is handed from one engine to another mid-stream (a decode worker changing
role: its sequence parked, the KV of the tokens the client has copied into the other engine's
reservation, admitted there with the KV present) goes on exactly as the first engine would
have, and the second engine computes none of it again."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.errors import FailedPrecondition, NotFound
from splitserve.engine.outputs import CompletionOutput, Resume
from tests.engine.hf_oracle import random_prompts

CASES = {
    "greedy_penalties": SamplingParams(
        temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.8,
        min_tokens=6, ignore_eos=True,
    ),
    "seeded": SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=20),
}  # fmt: skip
CONFIG = EngineConfig(block_size=16, num_kv_blocks=64)


def _run(engine: LLMEngine, request_id: str) -> CompletionOutput:
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0]


def _tokens_after(engine: LLMEngine, request_id: str, num_steps: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(num_steps):
        for out in engine.step():
            if out.request_id == request_id:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def _copy(src: LLMEngine, src_blocks, dst: LLMEngine, dst_blocks) -> None:
    pool = src.kv_connector.region().tensor
    data = torch.empty((len(src_blocks), *pool.shape[1:]), dtype=pool.dtype)
    src.kv_connector.read_blocks(src_blocks, data)
    dst.kv_connector.write_blocks(dst_blocks, data)


def _free(engine: LLMEngine) -> bool:
    s = engine.stats()
    return s.num_free_blocks == s.num_total_blocks and s.num_requests == 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_handed_off_sample_goes_on_as_the_first_engine_would_have(tiny_models, name):
    params = CASES[name]
    first, second = (LLMEngine(tiny_models["llama"], CONFIG) for _ in range(2))
    prompt = random_prompts([37], 500, seed=3)[0]
    first.add_request(prompt, params, "whole")
    whole = _run(first, "whole")
    assert len(whole.token_ids) == params.max_tokens
    for behind in (0, 3):  # the client has every token so far, or lags a few behind
        first.add_request(prompt, params, "moving")
        made = _tokens_after(first, "moving", 9)
        parked = first.park("moving")
        assert parked is not None and parked.num_tokens >= len(prompt) + len(made) - 1
        assert first.step() == []  # parked: no step, no output for it
        has = made[: len(made) - behind]
        rid = f"resumed-{behind}"
        res = second.reserve(rid, prompt, params, Resume(0, tuple(has)))
        num_tokens = len(prompt) + len(has) - 1
        src = first.take_parked("moving", num_tokens)
        start = res.num_cached_tokens // CONFIG.block_size
        _copy(first, src[start:], second, res.block_ids[start : len(src)])
        first.unpin_blocks(src)
        prefilled = second.stats().num_prefill_tokens
        second.admit(rid, params, None, kv_present=True)
        resumed = _run(second, rid)
        assert resumed.token_ids == whole.token_ids, behind
        assert resumed.text == whole.text
        assert second.stats().num_prefill_tokens == prefilled  # nothing recomputed
        assert _free(first) and _free(second)


def test_a_recomputed_resume_counts_its_prefill_and_a_handoff_of_more_than_parked_is_refused(
    tiny_models,
):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = LLMEngine(tiny_models["llama"], CONFIG)
    prompt = random_prompts([30], 500, seed=5)[0]
    engine.add_request(prompt, params, "r")
    _tokens_after(engine, "r", 4)
    parked = engine.park("r")
    assert parked is not None
    with pytest.raises(FailedPrecondition, match="holds KV for"):
        engine.take_parked("r", parked.num_tokens + 1)
    with pytest.raises(NotFound):
        engine.take_parked("r", 1)  # the refused hand-off freed it
    assert _free(engine)
    before = engine.stats().num_prefill_tokens
    res = engine.reserve("again", prompt, params, Resume(0, (1, 2, 3)))
    engine.admit("again", params, None)
    _run(engine, "again")
    recomputed = len(prompt) + 3 - res.num_cached_tokens
    assert engine.stats().num_prefill_tokens - before == recomputed
    engine.add_request(prompt, params, "aborted")
    _tokens_after(engine, "aborted", 3)
    assert engine.park("aborted") is not None and engine.abort_request("aborted")
    assert _free(engine)
