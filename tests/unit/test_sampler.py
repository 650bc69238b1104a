"""Behaviour of the Sampler: greedy, seeded and filtered sampling, penalties, bans, logprobs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    make_generator,
)
from splitserve.engine.sampling_params import SamplingParams

VOCAB = 50


def row(prompt=(), output=(), banned=(), generator=None, **params):
    sampling = SamplingParams(**params)
    if sampling.seed is not None and generator is None:
        generator = make_generator(sampling.seed)
    return SamplingRow(sampling, list(prompt), list(output), generator, frozenset(banned))


def random_logits(num_rows, vocab=VOCAB, seed=0):
    return torch.randn(num_rows, vocab, generator=make_generator(seed)) * 3


# A crafted distribution over 8 tokens, deliberately not sorted by id.
CRAFTED_PROBS = {3: 0.40, 0: 0.25, 6: 0.15, 1: 0.10, 7: 0.05, 2: 0.03, 5: 0.015, 4: 0.005}


def crafted_logits(num_rows):
    logits = torch.empty(8)
    for token, p in CRAFTED_PROBS.items():
        logits[token] = math.log(p)
    return logits.expand(num_rows, 8).clone()


def test_greedy_equals_argmax_for_every_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        logits = random_logits(6).to(dtype)
        out = Sampler()(logits, [row(temperature=0.0) for _ in range(6)])
        assert out.token_ids == logits.float().argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 6


def test_greedy_ties_pick_first_index_and_input_is_not_modified():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [7.0, 7.0, 7.0, 7.0]])
    before = logits.clone()
    out = Sampler()(logits, [row(temperature=0.0, repetition_penalty=1.5, output=[3])] * 2)
    assert out.token_ids == [1, 0]
    assert torch.equal(logits, before)


def test_logprobs_come_from_raw_logits_and_hold_sampled_plus_top_n():
    logits = random_logits(4)
    rows = [
        row(temperature=0.0, logprobs=5, repetition_penalty=2.0, output=[1, 2], banned=[3]),
        row(temperature=0.8, top_k=3, logprobs=0, seed=1),
        row(temperature=1.5, logprobs=20, presence_penalty=1.0, output=[4]),
        row(temperature=1.0),
    ]
    out = Sampler()(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[3] is None
    for i, n in ((0, 5), (1, 0), (2, 20)):
        entry = out.logprobs[i]
        top = set(expected[i].topk(n).indices.tolist()) if n else set()
        assert set(entry) == top | {out.token_ids[i]}
        assert len(entry) in (n, n + 1)
        for token, logprob in entry.items():
            assert abs(logprob - expected[i, token].item()) <= 1e-6


def test_seeded_row_repeats_exactly_whatever_else_is_in_the_batch():
    target = random_logits(1, vocab=1000, seed=7)[0]

    def run(others, position):
        generator = make_generator(1234)
        tokens = []
        for step in range(20):
            logits = random_logits(len(others) + 1, vocab=1000, seed=100 + step)
            logits[position] = target
            rows = list(others)
            rows.insert(position, row(seed=1234, generator=generator, temperature=1.3, top_p=0.9))
            tokens.append(Sampler()(logits, rows).token_ids[position])
        return tokens

    alone = run([], 0)
    assert run([row(), row(temperature=0.0)], 2) == alone
    assert run([row(seed=99), row(), row(top_k=5, seed=5)], 1) == alone
    assert len(set(alone)) > 1  # the row really samples, it is not degenerate


def test_different_seeds_give_different_draws():
    logits = torch.zeros(1, 1000)  # uniform, so any two seeds agreeing is a 1e-3 coincidence

    def draws(seed):
        generator = make_generator(seed)
        return [
            Sampler()(logits, [row(seed=seed, generator=generator)]).token_ids[0] for _ in range(10)
        ]

    sequences = {tuple(draws(seed)) for seed in range(5)}
    assert len(sequences) == 5


def test_top_k_one_equals_greedy():
    logits = random_logits(8)
    greedy = Sampler()(logits, [row(temperature=0.0) for _ in range(8)])
    top1 = Sampler()(logits, [row(top_k=1, temperature=2.0, seed=i) for i in range(8)])
    assert top1.token_ids == greedy.token_ids


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 3}, {3, 0, 6}),
        ({"top_p": 0.7}, {3, 0, 6}),  # mass ahead of token 1 is 0.80 >= 0.7
        ({"top_p": 0.3}, {3}),
        ({"min_p": 0.3}, {3, 0, 6}),  # 0.3 * 0.40 = 0.12 drops 0.10 and below
        ({"min_p": 0.1, "top_k": 4}, {3, 0, 6, 1}),
        ({"top_k": 5, "top_p": 0.8}, {3, 0, 6}),  # renormalised over top 5: .42 .26 .16 | .11
    ],
)
def test_filters_never_produce_tokens_outside_allowed_set(params, allowed):
    torch.manual_seed(0)
    num_draws = 4000
    out = Sampler()(crafted_logits(num_draws), [row(**params) for _ in range(num_draws)])
    assert set(out.token_ids) == allowed  # nothing outside, and nothing allowed starved


def test_filters_hold_for_seeded_rows_too():
    generator = make_generator(3)
    rows = [row(top_p=0.7, seed=3, generator=generator)]
    tokens = {Sampler()(crafted_logits(1), rows).token_ids[0] for _ in range(300)}
    assert tokens == {3, 0, 6}


def test_temperature_sampling_frequencies_match_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature, num_draws = 0.7, 20000
    out = Sampler()(logits.expand(num_draws, 5).clone(), [row(temperature=temperature)] * num_draws)
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * num_draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 18.47  # 99.9th percentile of chi-square with 4 degrees of freedom


def test_penalty_helper_matches_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [1.0, 1.0, -1.0, -1.0, 0.0, 4.0]])
    prompts, outputs = [[0, 1], [5]], [[2, 2, 3, 1], [4, 4, 4]]
    rep, pres, freq = [1.5, 2.0], [0.5, -0.25], [0.1, 0.3]
    expected = logits.clone()
    for r in range(2):
        for token in range(6):
            value = expected[r, token].item()
            if token in prompts[r] or token in outputs[r]:
                value = value / rep[r] if value > 0 else value * rep[r]
            count = outputs[r].count(token)
            value -= freq[r] * count + (pres[r] if count else 0.0)
            expected[r, token] = value
    apply_penalties(
        logits, prompts, outputs, torch.tensor(rep), torch.tensor(pres), torch.tensor(freq)
    )
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("logits", "kwargs"),
    [
        ([2.0, 1.9], {"repetition_penalty": 1.2, "output": [0]}),  # 2 / 1.2 < 1.9
        ([-1.0, -1.1], {"repetition_penalty": 1.2, "prompt": [0]}),  # -1 * 1.2 < -1.1
        ([2.0, 1.9], {"presence_penalty": 0.2, "output": [0]}),  # 2 - 0.2 < 1.9
        ([2.0, 1.9], {"frequency_penalty": 0.06, "output": [0, 0]}),  # 2 - 2 * 0.06 < 1.9
        ([2.0, 1.9], {"presence_penalty": -0.2, "output": [1]}),  # negative rewards token 1
    ],
)
def test_penalties_flip_greedy_choice(logits, kwargs):
    tensor = torch.tensor([logits, logits])
    rows = [row(temperature=0.0), row(temperature=0.0, **kwargs)]
    assert Sampler()(tensor, rows).token_ids == [0, 1]  # only the penalised row flips


def test_neutral_penalties_or_prompt_only_presence_do_not_flip():
    tensor = torch.tensor([[2.0, 1.9]])
    out = Sampler()(tensor, [row(temperature=0.0, presence_penalty=1.0, prompt=[0])])
    assert out.token_ids == [0]  # presence/frequency look at the output only


def test_banned_ids_are_never_sampled():
    torch.manual_seed(0)
    logits = torch.zeros(500, 6)
    logits[:, 2] = 20.0  # the banned token would otherwise win almost always
    rows = [row(temperature=0.0 if i % 2 else 1.0, banned=[2, 4]) for i in range(500)]
    tokens = set(Sampler()(logits, rows).token_ids)
    assert not tokens & {2, 4}
    assert tokens == {0, 1, 3, 5}


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 5), [row()])
    with pytest.raises(ValueError, match="banned"):
        Sampler()(torch.zeros(1, 5), [row(banned=[5])])
    with pytest.raises(ValueError, match="generator"):
        SamplingRow(SamplingParams(seed=1), [], [])


def test_empty_batch_returns_empty_output():
    out = Sampler()(torch.zeros(0, 5), [])
    assert out.token_ids == [] and out.logprobs == []


@st.composite
def sampling_rows(draw, vocab):
    params = draw(
        st.fixed_dictionaries(
            {
                "temperature": st.sampled_from([0.0, 1e-4, 0.5, 1.0, 3.0]),
                "top_p": st.floats(0.01, 1.0),
                "top_k": st.integers(-1, vocab + 5),
                "min_p": st.floats(0.0, 1.0),
                "seed": st.none() | st.integers(0, 2**32),
                "repetition_penalty": st.floats(0.1, 5.0),
                "presence_penalty": st.floats(-2.0, 2.0),
                "frequency_penalty": st.floats(-2.0, 2.0),
                "logprobs": st.none() | st.integers(0, 20),
            }
        )
    )
    ids = st.lists(st.integers(0, vocab - 1), max_size=10)
    banned = draw(st.frozensets(st.integers(0, vocab - 1), max_size=vocab - 1))
    return row(prompt=draw(ids), output=draw(ids), banned=banned, **params)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 40), st.integers(1, 5))
def test_random_valid_rows_never_crash_and_return_allowed_tokens(data, vocab, num_rows):
    rows = [data.draw(sampling_rows(vocab)) for _ in range(num_rows)]
    logits = random_logits(num_rows, vocab, seed=data.draw(st.integers(0, 1000)))
    out = Sampler()(logits.to(data.draw(st.sampled_from([torch.float32, torch.bfloat16]))), rows)
    assert len(out.token_ids) == num_rows
    for r, token, logprobs in zip(rows, out.token_ids, out.logprobs, strict=True):
        assert 0 <= token < vocab and token not in r.banned_token_ids
        if r.params.logprobs is None:
            assert logprobs is None
        else:
            n = min(r.params.logprobs, vocab)
            assert token in logprobs and len(logprobs) in (n, n + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_for_greedy_and_runs_seeded():
    logits = random_logits(4)
    rows = [row(temperature=0.0, repetition_penalty=1.3, output=[1], logprobs=2)] * 4
    assert Sampler()(logits.cuda(), rows).token_ids == Sampler()(logits, rows).token_ids
    for device in ("cuda", "cpu"):  # a CPU generator with CUDA logits must work too
        first, again = (
            Sampler()(
                logits[:1].cuda(), [row(seed=5, generator=make_generator(5, device), top_p=0.9)]
            )
            for _ in range(2)
        )
        assert first.token_ids == again.token_ids
