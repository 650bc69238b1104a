"""A draft that is always wrong costs few verifications: its sequences sit out speculation
(acceptance backoff) and the outputs still equal HF's."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.spec_decode.config import SpeculativeConfig
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow


def _always_wrong(llm: LLM) -> None:
    """Every draft token replaced by the next id: the draft model still runs, nothing matches
    the target... except by the rare chance the target picks that id."""
    proposer = llm.engine.speculator.proposer  # type: ignore[union-attr]
    propose = proposer.propose
    vocab = llm.engine.model_config.vocab_size

    def wrong(items, tables):  # type: ignore[no-untyped-def]
        return {sid: [(t + 1) % vocab for t in d] for sid, d in propose(items, tables).items()}

    proposer.propose = wrong  # type: ignore[method-assign]


@pytest.mark.parametrize("min_accepted", [0.5, 0.0])
def test_rejected_drafts_back_off_without_changing_outputs(tiny_models, min_accepted):
    model_dir = tiny_models["llama"]
    spec = SpeculativeConfig("draft", 3, draft_layers=1, min_accepted=min_accepted)
    llm = LLM(model_dir, speculative=spec)
    _always_wrong(llm)
    prompts = random_prompts([12, 20], llm.engine.model_config.vocab_size, seed=51)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(model_dir, tuple(p), 48) for p in prompts]
    stats = llm.engine.stats()
    if min_accepted:
        # 2 sequences x 47 decode steps: 2 steps each, then probes after 2, 4, 8, 16 steps.
        assert 0 < stats.spec_decode_num_drafts <= 2 * 8
    else:
        assert stats.spec_decode_num_drafts >= 2 * 40  # no backoff: every step speculates
    llm.engine.check_integrity()


def test_the_first_decode_step_is_plain_and_a_probe_drafts_one_token(tiny_models):
    """A sequence's first decode step proposes nothing (its second token comes as fast as
    without speculation: a decode worker's first step after the KV landed), and once its drafts
    failed, each probe proposes one token, not K."""
    model_dir = tiny_models["llama"]
    spec = SpeculativeConfig("draft", 3, draft_layers=1, min_accepted=0.5)
    llm = LLM(model_dir, speculative=spec)
    _always_wrong(llm)
    prompt = random_prompts([16], llm.engine.model_config.vocab_size, seed=52)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.stats().spec_decode_num_drafts == 0  # its one decode step was plain
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(model_dir, tuple(prompt), 48)
    stats = llm.engine.stats()
    full, probes = 2, stats.spec_decode_num_drafts - 2  # two of K, then pauses and probes
    assert probes >= 3
    assert stats.spec_decode_num_draft_tokens == 3 * full + probes
    llm.engine.check_integrity()
