"""Verification: which drafts the target accepts, from one forward over the k + 1 positions.

Row j of a speculating sequence's logits follows its tokens plus drafts[:j]:

    inputs     [ last token | d1 | d2 | ... | dk ]
    logits      row 0        row 1 ...        row k
    predicts    d1?          d2?              bonus

Greedy rows accept the longest prefix of drafts that equals the target's argmax, then add the
target's token at the first mismatch (or after the last draft: the bonus token). Random rows use
rejection sampling (Leviathan et al., 2023), which keeps the target's distribution exactly:
draft x is accepted with probability min(1, p(x) / q(x)); on a rejection the token is drawn
from norm(max(0, p - q)). Every proposer here makes point-mass drafts (q = 1 at x), so the
acceptance probability is p(x) and the residual is p with x removed. p is the sampler's own
distribution for that position (bans, penalties, temperature, min-p, top-k, top-p), and each
position draws from its own keyed generator (`sequence.step_generator`), so a seeded request's
draws stay deterministic per (seed, sample, position).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from splitserve.engine.sampler import Sampler, SamplingRow, _plain_greedy
from splitserve.engine.sequence import Sequence


def accept_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """The tokens a greedy row emits: drafts while they equal the target's, then the target's
    own token (the correction, or the bonus after the last draft)."""
    out: list[int] = []
    for draft, target in zip(drafts, target_ids, strict=False):
        out.append(target)
        if target != draft:
            return out
    out.append(target_ids[len(drafts)])
    return out


def rejection_sample(
    probs: torch.Tensor,
    drafts: list[int],
    rows: list[SamplingRow],
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Accepted drafts then one more token, distributed exactly as the target's `probs`.

    `probs` is [k + 1, vocab] (row j: the target's distribution after drafts[:j]); `rows[j]`
    carries position j's generator; `draft_probs` ([k, vocab]) is q, None for point masses.
    """
    out: list[int] = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        q_x = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        gen = rows[j].generator
        u = float(torch.rand((), generator=gen)) if gen is not None else float(torch.rand(()))
        if u * q_x < float(p[draft]):
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[j].to(p.device)).clamp_(min=0.0)
        total = residual.sum()
        residual = residual / total if float(total) > 0 else p
        out.append(int(Sampler.race(residual.unsqueeze(0), rows[j : j + 1])[0]))
        return out
    k = len(drafts)
    out.append(int(Sampler.race(probs[k : k + 1].clone(), rows[k : k + 1])[0]))
    return out


def position_rows(
    seq: Sequence, drafts: list[int], make_row: Callable[[Sequence], SamplingRow]
) -> list[SamplingRow]:
    """The sampling row of each verified position: as if drafts[:j] were already output (for
    penalties, min_tokens bans and the keyed generator's position)."""
    rows = []
    for j in range(len(drafts) + 1):
        view = copy.copy(seq)
        view.output_token_ids = seq.output_token_ids + drafts[:j]
        rows.append(make_row(view))
    return rows


def verify(
    logits: torch.Tensor,
    seqs: list[Sequence],
    drafts: list[list[int]],
    sampler: Sampler,
    make_row: Callable[[Sequence], SamplingRow],
) -> list[list[int]]:
    """Tokens each speculating sequence emits this step. `logits` holds len(drafts[i]) + 1 rows
    per sequence, in order."""
    # NOTE: a sequence whose first position is plain greedy is so at every later one (its only
    # per-position ban, min_tokens, lifts as the output grows): no per-position rows to build.
    if all(_plain_greedy(make_row(seq)) for seq in seqs):
        argmax = logits.argmax(dim=-1).tolist()  # one read-back for the whole batch
        results, start = [], 0
        for d in drafts:
            results.append(accept_greedy(argmax[start : start + len(d) + 1], d))
            start += len(d) + 1
        return results
    rows = [position_rows(seq, d, make_row) for seq, d in zip(seqs, drafts, strict=True)]
    flat = [row for per_seq in rows for row in per_seq]
    probs = sampler.probs(logits, flat)
    results, start = [], 0
    for d, per_seq in zip(drafts, rows, strict=True):
        p = probs[start : start + len(d) + 1]
        start += len(d) + 1
        if per_seq[0].params.is_greedy:
            results.append(accept_greedy(p.argmax(dim=-1).tolist(), d))
        else:
            results.append(rejection_sample(p, d, per_seq))
    return results
