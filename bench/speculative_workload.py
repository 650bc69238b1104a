"""The speculative benchmark's workload parts (bench/speculative.py): a dummy target whose first
layers decide its tokens, drafts corrupted on purpose, and a decode worker's admission timed to
the second token."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from bench.common import sync


def quiet_deep_layers(model: Any, first: int, factor: float) -> None:
    """Scale the output projections (o_proj, down_proj) of layers `first`.. of `model` by
    `factor`: the residual stream after layer `first` then decides the greedy token, so a draft
    of the first `first` layers agrees with the target, while every layer still reads the same
    bytes and does the same FLOPs (the plain baseline's step time is unchanged)."""
    with torch.no_grad():
        for layer in list(model.model.layers)[first:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)


def corrupt_drafts(engine: Any, rate: float, vocab: int, seed: int = 0) -> None:
    """Replace each draft token by a random one with probability `rate` (acceptance on
    purpose); the draft model still runs."""
    if rate <= 0:
        return
    proposer = engine.speculator.proposer
    propose = proposer.propose
    rng = random.Random(seed)

    def corrupted(items, tables):  # type: ignore[no-untyped-def]
        drafts = propose(items, tables)
        return {
            sid: [rng.randrange(vocab) if rng.random() < rate else t for t in toks]
            for sid, toks in drafts.items()
        }

    proposer.propose = corrupted


def second_token_after_admission(engine: Any, context: int, reps: int, gen: random.Random) -> float:
    """Median time (ms) from admitting a prefilled request on a decode engine (the
    disaggregated path: its prompt KV written by a prefill worker, not computed here) to its
    second token. With a draft model this includes the draft's catch-up on the prompt."""
    from splitserve.engine import SamplingParams
    from splitserve.engine.outputs import SampledToken

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    times = []
    for rep in range(reps):
        prompt = [gen.randrange(3, vocab) for _ in range(context)]
        rid = f"pd-{rep}"
        engine.reserve(rid, prompt, params)  # NOTE: the KV's values do not matter for timing
        sync()
        start = time.perf_counter()
        engine.admit(rid, params, [SampledToken(gen.randrange(3, vocab))])
        while not any(len(o.outputs[0].token_ids) >= 2 for o in engine.step()):
            pass
        sync()
        times.append((time.perf_counter() - start) * 1e3)
        engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return sorted(times)[len(times) // 2]
