"""Logprobs, seeded sampling, parallel sampling (n > 1), stop conditions and priorities."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.config import EngineConfig
from tests.engine.hf_oracle import hf_greedy, hf_logprobs, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"])


def _vocab(llm: LLM) -> int:
    return llm.engine.model_config.vocab_size


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logprobs_match_hf_log_softmax(tiny_models, arch):
    llm = LLM(tiny_models[arch])
    prompts = random_prompts([7, 50, 130], _vocab(llm), seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        sample = out.outputs[0]
        ref = hf_logprobs(tiny_models[arch], prompt, sample.token_ids)
        assert len(sample.logprobs) == len(sample.token_ids)
        for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
            assert token in entry and len(entry) in (5, 6)
            top5 = set(torch.topk(ref[step], 5).indices.tolist())
            assert top5 <= set(entry)
            for token_id, logprob in entry.items():
                assert abs(logprob - ref[step, token_id].item()) < 1e-4


def test_seeded_sampling_repeats_whatever_the_batch(llm):
    prompts = random_prompts([12, 40, 77], _vocab(llm), seed=4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=0.8, max_tokens=25, ignore_eos=True)
    batched = llm.generate(prompts, [other, seeded, other], use_tqdm=False)[1]
    assert batched.outputs[0].token_ids == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=99, ignore_eos=True)
    assert llm.generate([prompts[1]], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_parallel_sampling_shares_prompt_blocks(tiny_models):
    engine = LLMEngine(tiny_models["llama"], EngineConfig(enable_prefix_caching=False))
    prompt = random_prompts([40], engine.model_config.vocab_size, seed=5)[0]  # 2.5 blocks
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    engine.add_request(prompt, params, request_id="r")
    engine.step()  # prefill + first sample, forked into 4 sequences
    usage = engine.kv_usage()
    assert usage.num_sequences == 4
    assert usage.num_used_blocks == 3, "the 4 samples must share the prompt's 3 blocks"
    engine.step()  # each sibling writes its own token: the shared partial block is copied
    usage = engine.kv_usage()
    assert usage.num_used_blocks == 2 + 4, "2 shared full blocks + one last block per sample"
    engine.check_integrity()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None and final.finished and len(final.outputs) == 4
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1, "samples should differ"
    assert engine.kv_usage().num_used_blocks == 0


def test_parallel_greedy_samples_all_equal_hf(tiny_models):
    llm = LLM(tiny_models["mistral"])
    prompt = random_prompts([45], _vocab(llm), seed=6)[0]
    params = SamplingParams(n=3, temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    expected = hf_greedy(tiny_models["mistral"], tuple(prompt), 32)
    assert [o.token_ids for o in out.outputs] == [expected] * 3


def test_stop_token_ids_and_max_tokens_end_generation(llm):
    prompt = random_prompts([20], _vocab(llm), seed=9)[0]
    base = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(base.token_ids) == 20 and base.finish_reason == "length"
    stop_at = base.token_ids[5]
    first = base.token_ids.index(stop_at)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_min_tokens_suppresses_stop_tokens(llm):
    prompt = random_prompts([20], _vocab(llm), seed=9)[0]
    base = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    params = SamplingParams(
        temperature=0, max_tokens=10, min_tokens=10, stop_token_ids=[base.token_ids[0]]
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and base.token_ids[0] not in out.token_ids


def test_stop_string_cuts_text_and_finishes(llm):
    prompt = "The quick brown fox"
    base = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    text = base.text
    middle = [
        i
        for i in range(len(text) // 4, 3 * len(text) // 4)
        if text[i : i + 2].isprintable()
        and not text[i : i + 2].isspace()
        and "\ufffd" not in text[i : i + 2]
    ]
    assert middle, f"greedy text {base.text!r} has no usable stop string"
    stop = base.text[middle[0] : middle[0] + 2]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.find(stop)]
    assert stop not in out.text and len(out.token_ids) < len(base.token_ids)


def test_text_prompts_and_detokenized_text_match_tokens(llm):
    tok = llm.engine.tokenizer
    outs = llm.generate(
        ["héllo wörld", "日本語のテキスト", "x"],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    for out in outs:
        assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=True)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_priority_policy_runs_urgent_request_first(tiny_models):
    engine = LLMEngine(
        tiny_models["llama"], EngineConfig(max_num_seqs=1, scheduling_policy="priority")
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="low", priority=10)
    engine.add_request([8, 9, 10], params, request_id="high", priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_unused_slots_stay_within_one_partial_block_per_sequence(tiny_models):
    engine = LLMEngine(tiny_models["qwen2"], EngineConfig(max_num_batched_tokens=96))
    prompts = random_prompts([3, 17, 33, 64, 90, 5, 150, 47, 31, 16, 2, 71], 400, seed=11)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            prompt, SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True)
        )
    bs = engine.config.block_size
    max_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        usage = engine.kv_usage()
        assert usage.num_unused_slots <= usage.num_sequences * (bs - 1)
        max_seen = max(max_seen, usage.num_sequences)
        engine.check_integrity()
    assert max_seen >= 8, "the check should run with many sequences at once"


def test_abort_frees_blocks(tiny_models):
    engine = LLMEngine(tiny_models["llama"])
    engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=50), request_id="a")
    engine.step()
    assert engine.kv_usage().num_used_blocks > 0
    engine.abort_request("a")
    assert engine.kv_usage().num_used_blocks == 0 and not engine.has_unfinished_requests()
    engine.check_integrity()
