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
