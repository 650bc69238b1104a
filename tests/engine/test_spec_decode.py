"""Speculative decoding is lossless: with n-gram (prompt lookup) proposals, greedy float32
outputs are token-identical to HF and to the engine without speculation, through chunked
prefill, prefix-cache hits, preemption and stop conditions inside an accepted run; rejected
drafts' KV slots are given back."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.spec_decode.config import SpeculativeConfig
from splitserve.engine.spec_decode.ngram import ngram_lookup
from splitserve.engine.spec_decode.verify import accept_greedy
from tests.engine.hf_oracle import hf_greedy, random_prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4)


def repeated_prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    """Prompts with repeated spans (n-gram drafts get proposed), and plain random ones."""
    spans = random_prompts([9, 20, 5], vocab, seed=seed)
    return [s * 3 for s in spans] + random_prompts([14, 37], vocab, seed=seed + 1)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_speculated_and_clean(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0, "no draft was proposed"
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, (
        "expected some drafts accepted and some rejected"
    )
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == (
        stats.spec_decode_num_accepted_tokens
    )
    llm.engine.check_integrity()
    usage = llm.engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_sequences == 0


def test_ngram_lookup_takes_what_followed_the_latest_match():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    assert ngram_lookup([5, 6, 7, 8], 3, 1, 3) == []  # nothing repeats
    assert ngram_lookup([4, 4, 4], 4, 1, 2) == [4]  # what followed is all there is
    # a byte pattern that matches across a token boundary is not a hit
    assert ngram_lookup([0x0100, 0x0200, 5, 0x02], 2, 1, 1) == []


def test_greedy_acceptance_is_the_longest_matching_prefix_plus_one():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # corrected at the mismatch
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]


def test_ngram_greedy_matches_hf_and_plain(tiny_models):
    model_dir = tiny_models["llama"]
    llm = LLM(model_dir, speculative=NGRAM)
    prompts = repeated_prompts(llm.engine.model_config.vocab_size)
    got = _tokens(llm, prompts)
    assert got == [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    _assert_speculated_and_clean(llm)


def test_each_request_output_counts_the_speculation_it_saw(tiny_models):
    llm = LLM(tiny_models["llama"], speculative=NGRAM)
    prompts = repeated_prompts(llm.engine.model_config.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    usages = [o.speculation for o in outputs if o.speculation is not None]
    assert len(usages) >= 3, "the repeated prompts' requests must have speculated"
    for u in usages:
        assert 0 < u.num_drafts <= u.num_draft_tokens <= NGRAM.num_speculative_tokens * u.num_drafts
        assert 0 <= u.num_accepted_tokens <= u.num_draft_tokens
        # each verification emitted its accepted drafts and one more: no more than generated
        assert u.num_drafts + u.num_accepted_tokens <= MAX_NEW
        assert u.mean_acceptance_length == 1 + u.num_accepted_tokens / u.num_drafts
    # the requests' counts are the engine's, split by request
    stats = llm.engine.stats()
    assert sum(u.num_drafts for u in usages) == stats.spec_decode_num_drafts
    assert sum(u.num_draft_tokens for u in usages) == stats.spec_decode_num_draft_tokens
    assert sum(u.num_accepted_tokens for u in usages) == stats.spec_decode_num_accepted_tokens
    plain = LLM(tiny_models["llama"]).generate(prompts[:1], GREEDY, use_tqdm=False)
    assert plain[0].speculation is None


@pytest.mark.slow
def test_ngram_with_chunked_prefill_and_prefix_hits_matches_hf(tiny_models):
    model_dir = tiny_models["qwen2"]
    llm = LLM(model_dir, speculative=NGRAM, max_num_batched_tokens=24)
    vocab = llm.engine.model_config.vocab_size
    shared = random_prompts([11], vocab, seed=9)[0] * 4  # 44 tokens: two full blocks
    prompts = [shared + s for s in random_prompts([3, 12], vocab, seed=10)]
    first = _tokens(llm, prompts[:1])
    rest = _tokens(llm, prompts[1:])
    assert first + rest == [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    assert llm.engine.block_manager.prefix_cache_hits >= 32
    _assert_speculated_and_clean(llm)


@pytest.mark.slow
def test_ngram_under_preemption_matches_hf(tiny_models):
    model_dir = tiny_models["llama"]
    # 12 blocks of 16 slots can't hold five sequences of ~40-90 tokens at once.
    llm = LLM(model_dir, speculative=NGRAM, num_kv_blocks=12)
    prompts = repeated_prompts(llm.engine.model_config.vocab_size, seed=5)
    got = _tokens(llm, prompts)
    assert got == [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_speculated_and_clean(llm)


@pytest.fixture(scope="module")
def llm_pair(tiny_models):
    model_dir = tiny_models["llama"]
    return LLM(model_dir), LLM(model_dir, speculative=SpeculativeConfig("ngram", 6))


def _outputs(llm: LLM, prompts, params):
    return [
        (o.token_ids, o.finish_reason, o.stop_reason, o.text)
        for r in llm.generate(prompts, params, use_tqdm=False)
        for o in r.outputs
    ]


@pytest.mark.slow
def test_stops_inside_an_accepted_run_drop_the_tokens_after_them(llm_pair):
    plain, spec = llm_pair
    prompts = repeated_prompts(plain.engine.model_config.vocab_size, seed=11)
    base = _tokens(plain, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # A stop token, an EOS-like stop (min_tokens holds it back), a short max_tokens and a
    # stop string taken from inside each greedy text.
    cases = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[base[0][7]]),
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, min_tokens=12,
            stop_token_ids=[base[0][3], base[2][5]],
        ),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]  # fmt: skip
    for params in cases:
        assert _outputs(spec, prompts, params) == _outputs(plain, prompts, params)
    texts = [o[3] for o in _outputs(plain, prompts, GREEDY)]
    for prompt, text in zip(prompts, texts, strict=True):
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if not stop.strip() or "\ufffd" in stop:
            continue
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop])
        assert _outputs(spec, [prompt], params) == _outputs(plain, [prompt], params)
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
    spec.engine.check_integrity()


@pytest.mark.slow
def test_mixed_batch_of_speculating_and_plain_requests(llm_pair):
    plain, spec = llm_pair
    prompts = repeated_prompts(plain.engine.model_config.vocab_size, seed=13)
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=2),
    ]
    before = spec.engine.stats().spec_decode_num_drafts
    got = spec.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    for i in (0, 1, 3, 4):  # greedy rows: identical (logprobs too; n > 1 samples too)
        assert [o.token_ids for o in got[i].outputs] == [o.token_ids for o in want[i].outputs]
        got_lp, want_lp = got[i].outputs[0].logprobs or [], want[i].outputs[0].logprobs or []
        for a, b in zip(got_lp, want_lp, strict=True):
            assert a.keys() == b.keys()  # values: equal up to batch-shape rounding
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert len(got[2].outputs[0].token_ids) == MAX_NEW  # sampled: same law, not same tokens
    assert spec.engine.stats().spec_decode_num_drafts > before
    spec.engine.check_integrity()


def test_batch_size_table_turns_speculation_down():
    spec = SpeculativeConfig("ngram", 4, k_by_batch_size=((1, 4), (8, 2), (32, 1)))
    assert [spec.num_tokens_for(b) for b in (1, 2, 8, 9, 32, 33)] == [4, 2, 2, 1, 1, 0]
    assert SpeculativeConfig("ngram", 3).num_tokens_for(32) == 3
    assert SpeculativeConfig("ngram", 3).num_tokens_for(33) == 0
    with pytest.raises(ValueError, match="ascending"):
        SpeculativeConfig("ngram", 4, k_by_batch_size=((8, 2), (4, 1)))
    with pytest.raises(ValueError, match="exactly one of"):
        SpeculativeConfig("draft", 4)


def test_no_speculation_above_the_table(tiny_models):
    off_at_two = SpeculativeConfig("ngram", 4, k_by_batch_size=((1, 4),))
    llm = LLM(tiny_models["llama"], speculative=off_at_two)
    prompts = repeated_prompts(llm.engine.model_config.vocab_size)[:2]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # both run together to the end
    assert llm.engine.stats().spec_decode_num_drafts == 0
    llm.generate(prompts[:1], params, use_tqdm=False)
    assert llm.engine.stats().spec_decode_num_drafts > 0


def test_trim_gives_back_the_blocks_past_the_accepted_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("s", 6)
    bm.cache_blocks("s", list(range(6)), 4)
    bm.allocate("s", 13)  # 6 known + 7 draft slots: 4 blocks
    assert len(bm.block_table("s")) == 4
    bm.trim("s", 8)
    assert len(bm.block_table("s")) == 2 and bm.usage().num_free_blocks == 6
    bm.check_integrity()
    with pytest.raises(Exception, match="below its cached blocks"):
        bm.trim("s", 3)
