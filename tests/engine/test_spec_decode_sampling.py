"""Rejection sampling keeps the target's distribution exactly: a chi-square test cannot tell
speculative draws from plain ones at p = 0.01, with temperature, top-k and top-p on — on
crafted distributions through the acceptance function, and end to end through the engine."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.sampler import Sampler, SamplingRow
from splitserve.engine.sequence import Sequence, step_generator
from splitserve.engine.spec_decode.config import SpeculativeConfig
from splitserve.engine.spec_decode.verify import rejection_sample
from tests.engine.hf_oracle import random_prompts

VOCAB = 16
PARAMS = SamplingParams(temperature=0.9, top_k=10, top_p=0.9, max_tokens=8)


def _rows(num: int) -> list[SamplingRow]:
    return [SamplingRow(PARAMS, [1, 2], [3] * j) for j in range(num)]


def _fit(counts: Counter, probs: torch.Tensor, total: int) -> float:
    """p-value of `counts` against `probs` (tokens of probability 0 must never occur)."""
    support = [t for t in range(VOCAB) if probs[t] > 0]
    assert sum(counts[t] for t in range(VOCAB) if t not in support) == 0
    observed = [counts[t] for t in support]
    expected = [float(probs[t]) * total for t in support]
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def test_rejection_sampling_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=gen) * 1.5
    rows = _rows(3)
    probs = Sampler().probs(logits, rows)  # after temperature, top-k and top-p
    likely = int(probs[0].argsort(descending=True)[1])  # a draft accepted now and then
    outside = int(probs[1].argmin())  # a draft the target never makes (outside top-k/top-p)
    drafts = [likely, outside]
    torch.manual_seed(0)
    firsts, seconds = Counter(), Counter()
    runs = 20_000
    for _ in range(runs):
        out = rejection_sample(probs, drafts, rows)
        firsts[out[0]] += 1
        if out[0] == likely:
            seconds[out[1]] += 1
    assert 0 < firsts[likely] < runs, "the draft must be accepted sometimes, rejected sometimes"
    assert _fit(firsts, probs[0], runs) > 0.01
    # After an accepted first draft, the second position follows p[1] (its draft never wins).
    assert _fit(seconds, probs[1], firsts[likely]) > 0.01


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(5)
    rows = _rows(2)
    probs = Sampler().probs(torch.randn(2, VOCAB, generator=gen), rows)
    q = torch.softmax(torch.randn(1, VOCAB, generator=gen), dim=-1)
    torch.manual_seed(0)
    counts: Counter = Counter()
    runs = 20_000
    for _ in range(runs):
        draft = int(torch.multinomial(q[0], 1))
        counts[rejection_sample(probs, [draft], rows, draft_probs=q)[0]] += 1
    assert _fit(counts, probs[0], runs) > 0.01


def test_seeded_verification_is_deterministic_per_position():
    seq = Sequence("r#0", "r", [1, 2, 3], SamplingParams(temperature=1.0, seed=42), 0.0)
    probs = Sampler().probs(torch.randn(3, VOCAB), _rows(3))

    def draw() -> list[int]:
        rows = []
        for j in range(3):
            seq.output_token_ids = [7] * j
            rows.append(SamplingRow(seq.params, [1], [7] * j, generator=step_generator(seq)))
        return rejection_sample(probs, [7, 7], rows)

    assert draw() == draw()


@pytest.mark.slow
def test_speculative_sampling_matches_plain_sampling_end_to_end(tiny_models):
    model_dir = tiny_models["llama"]
    prompt = random_prompts([12], 500, seed=21)[0]
    # NOTE: 4 tokens: the first comes from the prefill, the second from a plain first decode
    # step; the third and fourth from a speculative step (one draft, one bonus token).
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.95, max_tokens=4, n=250)
    # The draft is the target itself: its argmax is proposed at every position (a point mass,
    # accepted with the target's probability of it), so rejection sampling runs at each one.
    table = ((256, 2),)
    draft = SpeculativeConfig("draft", 2, model=str(model_dir), k_by_batch_size=table)
    plain, spec = LLM(model_dir), LLM(model_dir, speculative=draft)

    def positions(llm: LLM) -> list[Counter]:
        counts: list[Counter] = [Counter() for _ in range(4)]
        # NOTE: 2000 samples per engine here (the acceptance function gets 20k above): the
        # tiny model on the CPU takes minutes for more.
        for out in llm.generate([prompt] * 8, params, use_tqdm=False):
            for sample in out.outputs:
                for j in range(len(sample.token_ids)):
                    # the joint law: each position's token together with those before it
                    counts[j][tuple(sample.token_ids[: j + 1])] += 1
        return counts

    want, got = positions(plain), positions(spec)
    stats = spec.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    for j in range(4):
        keys = sorted(set(want[j]) | set(got[j]))
        keys = [k for k in keys if want[j][k] + got[j][k] >= 10]  # chi-square needs counts
        table_ = [[want[j][k] for k in keys], [got[j][k] for k in keys]]
        assert chi2_contingency(table_).pvalue > 0.01, f"position {j} differs"
