"""On a GPU, speculative steps replayed as CUDA graphs give the plain engine's greedy tokens
(float32; the plain engine replays its own decode graphs): a draft that is the target itself
accepts every draft, a truncated one and n-gram verify mixed K. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.spec_decode.config import SpeculativeConfig
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 24


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    lens = [MAX_NEW - 3 * (i % 4) for i in range(len(prompts))]  # K capped near some ends
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "spec",
    [
        SpeculativeConfig("draft", 4, draft_layers=2, min_accepted=0),
        SpeculativeConfig("draft", 3, draft_layers=1, min_accepted=0),
        SpeculativeConfig("ngram", 4, min_accepted=0),
    ],
    ids=["target-as-draft", "truncated", "ngram"],
)
def test_graphed_speculation_gives_the_plain_engines_tokens(tiny_models, spec):
    model_dir = tiny_models["llama"]  # 2 layers: draft_layers=2 is the target itself
    kw = {"dtype": "float32", "device": "cuda", "max_num_seqs": 8}
    plain = LLM(model_dir, **kw)
    vocab = plain.engine.model_config.vocab_size
    spans = random_prompts([9, 20, 5], vocab, seed=61)
    prompts = [s * 3 for s in spans] + random_prompts([30, 17, 50], vocab, seed=62)
    want = _tokens(plain, prompts)
    del plain
    llm = LLM(model_dir, speculative=spec, **kw)
    assert llm.engine.runner.verify_steps, "no speculative graphs captured"
    assert _tokens(llm, prompts) == want
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    if spec.draft_layers == 2:  # the target itself (a near-tie may flip across batch shapes)
        assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens
    llm.engine.check_integrity()
