"""Turns one step's logits into next tokens, honouring each row's ``SamplingParams``.

The order of operations follows vLLM v1: structured outputs' grammar masks, logprobs from the
logits so far, then bans, penalties, greedy argmax, and for random rows temperature, min-p,
top-k, top-p and an exponential-race draw.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.grammar import GrammarState, TokenBitmask
from splitserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt, read only when ``repetition_penalty`` is not 1.
        output_token_ids: tokens generated so far by this sequence.
        generator: this sequence's RNG; required when ``params.seed`` is set. The sequence owns
            it so its draws do not depend on the rest of the batch. Best on the logits' device;
            one on another device works but costs a copy per step.
        banned_token_ids: ids that must not be produced this step, e.g. EOS and stop ids while
            ``min_tokens`` is not yet reached.
        grammar: the structured output's matcher; only tokens it allows next can be picked.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    banned_token_ids: frozenset[int] = frozenset()
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        if self.params.seed is not None and self.generator is None:
            # Falling back to the shared RNG would silently break the reproducibility asked for.
            raise ValueError(
                f"params.seed={self.params.seed} needs a generator; use make_generator()"
            )
        banned = frozenset(self.banned_token_ids)
        for token_id in banned:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"banned_token_ids must be ints >= 0, got {token_id!r}")
        object.__setattr__(self, "banned_token_ids", banned)


@dataclass(frozen=True)
class SamplerOutput:
    """The tokens picked for a batch, one entry per row in input order.

    Attributes:
        token_ids: the sampled token of each row.
        logprobs: per row, None if ``params.logprobs`` is None, else a dict token id -> logprob
            (of the raw logits) holding the sampled token and the top ``params.logprobs`` tokens,
            so it has ``logprobs`` or ``logprobs + 1`` entries.
    """

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """Return a generator seeded with ``seed`` on ``device``, for ``SamplingRow.generator``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _count_tokens(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Return a float32 [rows, vocab] tensor of how often each token occurs in each row."""
    num_rows = len(token_ids)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        # Checked on the host: an out-of-range index on CUDA is an unrecoverable device assert.
        low, high = int(flat.min()), int(flat.max())
        raise ValueError(f"token ids must be in [0, {vocab_size}), got ids from {low} to {high}")
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(num_rows), lengths)
    flat_index = (rows * vocab_size + flat).to(device, non_blocking=True)
    counts = torch.bincount(flat_index, minlength=num_rows * vocab_size)
    return counts.view(num_rows, vocab_size).to(torch.float32)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
) -> None:
    """Apply repetition, presence and frequency penalties to float32 ``logits`` in place.

    For a token seen in the prompt or output, a positive logit is divided by the repetition
    penalty and a negative one multiplied (the HF/vLLM rule, so >1 always makes it less likely).
    Then ``presence`` is subtracted once from every token in the output and ``frequency`` once
    per occurrence. The penalty tensors are [rows] on the logits' device.
    """
    vocab_size = logits.shape[1]
    output_counts = _count_tokens(output_token_ids, vocab_size, logits.device)
    in_output = output_counts > 0
    seen = in_output | (_count_tokens(prompt_token_ids, vocab_size, logits.device) > 0)
    repetition = repetition_penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(frequency_penalties.unsqueeze(1) * output_counts)
    logits.sub_(presence_penalties.unsqueeze(1) * in_output)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask to -inf, in place, tokens whose probability is below ``min_p`` times the row's max."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Return ``logits`` with tokens outside each row's top-k, then top-p nucleus, set to -inf.

    ``top_k`` is [rows] long with the vocabulary size meaning "keep all"; exactly k tokens are
    kept, ties broken towards the lower id as ``torch.argmax`` does. ``top_p`` is [rows] float;
    the nucleus is the smallest set of most likely tokens whose mass reaches p, computed on the
    top-k-renormalised distribution, and always holds the top token.
    """
    # A stable descending sort ranks equal logits by id, which keeps top_k=1 identical to argmax.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(rank >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly ahead of each token: the token is needed iff that is still below p.
        mass_ahead = probs.cumsum(dim=-1).roll(1, dims=-1)
        mass_ahead[:, 0] = 0.0
        p = top_p.unsqueeze(1)
        # p == 1 rows are exempt: rounding can push the running sum to 1 before the tail ends.
        sorted_logits.masked_fill_((mass_ahead >= p) & (p < 1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def plain_greedy_params(p: SamplingParams) -> bool:
    """Greedy with no logprobs or penalties (bans and grammars are per row, not per request)."""
    return (
        p.is_greedy
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy with no logprobs, bans or penalties: the token is the raw logits' argmax."""
    return row.grammar is None and not row.banned_token_ids and plain_greedy_params(row.params)


class Sampler:
    """Picks one token per row of a [rows, vocab] logits tensor.

    Works on any float dtype and device; the math is done in float32 on a copy, so the caller's
    tensor is never modified. Seeded rows draw only from their own generator, so a seeded request
    produces the same tokens whatever else shares its batch.
    """

    def __init__(self) -> None:
        self._bitmask = TokenBitmask()

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        argmax: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per row; see the module docstring for the order of operations.

        `argmax` ([rows] int64), when given, is each row's argmax of `logits` already computed
        (in the decode CUDA graph); plain greedy batches then only read it back.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        if all(_plain_greedy(row) for row in rows):
            # Nothing to adjust: argmax of the raw logits (exact in any float dtype), no copy.
            tokens = logits.argmax(dim=-1) if argmax is None else argmax
            return SamplerOutput(tokens.tolist(), [None] * len(rows))
        work = logits.to(dtype=torch.float32, copy=True)
        # Grammar masks come first: a constrained row's logprobs are over the tokens it allows.
        self._bitmask.apply(work, [row.grammar for row in rows])

        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = torch.log_softmax(work[self._index(logprob_rows, work)], dim=-1)

        self._ban(work, rows)
        self._penalise(work, rows)

        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        sampled = torch.empty(len(rows), dtype=torch.long, device=work.device)
        if greedy:
            index = self._index(greedy, work)
            sampled[index] = work[index].argmax(dim=-1)
        if random:
            index = self._index(random, work)
            sampled[index] = self._sample_random(work[index], [rows[i] for i in random])

        token_ids = sampled.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            self._fill_logprobs(logprobs, raw_logprobs, logprob_rows, sampled, token_ids, rows)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _index(row_ids: list[int], work: torch.Tensor) -> torch.Tensor | slice:
        if len(row_ids) == work.shape[0]:
            return slice(None)  # the whole batch: skip the gather copy
        return torch.tensor(row_ids, dtype=torch.long, device=work.device)

    @staticmethod
    def _ban(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        pairs = [(i, t) for i, row in enumerate(rows) for t in row.banned_token_ids]
        if not pairs:
            return
        vocab_size = work.shape[1]
        for _, token_id in pairs:
            if token_id >= vocab_size:
                raise ValueError(f"banned token id {token_id} is >= vocab size {vocab_size}")
        index = torch.tensor(pairs, dtype=torch.long, device=work.device)
        work[index[:, 0], index[:, 1]] = float("-inf")

    def _penalise(self, work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        selected = [
            i
            for i, row in enumerate(rows)
            if row.params.repetition_penalty != 1.0
            or row.params.presence_penalty != 0.0
            or row.params.frequency_penalty != 0.0
        ]
        if not selected:
            return
        params = [rows[i].params for i in selected]
        penalties = torch.tensor(
            [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params],
            dtype=torch.float32,
        ).to(work.device, non_blocking=True)
        # Prompts can be long; skip them for rows whose only penalties look at the output.
        prompts = [
            rows[i].prompt_token_ids if rows[i].params.repetition_penalty != 1.0 else ()
            for i in selected
        ]
        outputs = [rows[i].output_token_ids for i in selected]
        index = self._index(selected, work)
        sub = work[index]
        apply_penalties(sub, prompts, outputs, penalties[:, 0], penalties[:, 1], penalties[:, 2])
        work[index] = sub

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Each row's distribution after its grammar mask, bans, penalties, temperature, min-p,
        top-k and top-p, as float32 [rows, vocab]: what `__call__` draws from (one-hot at the
        argmax for greedy rows). Speculative verification (engine/spec_decode) accepts drafts
        against it."""
        work = logits.to(dtype=torch.float32, copy=True)
        self._bitmask.apply(work, [row.grammar for row in rows])
        self._ban(work, rows)
        self._penalise(work, rows)
        out = torch.zeros_like(work)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if greedy:
            index = self._index(greedy, work)
            picked = work[index].argmax(dim=-1, keepdim=True)
            out[index] = torch.zeros_like(work[index]).scatter_(1, picked, 1.0)
        if random:
            index = self._index(random, work)
            out[index] = self._random_probs(work[index], [rows[i] for i in random])
        return out

    @staticmethod
    def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        return Sampler.race(Sampler._random_probs(logits, rows), rows)

    @staticmethod
    def _random_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Softmax after temperature, min-p, top-k and top-p (in place on `logits`)."""
        vocab_size = logits.shape[1]
        params = [row.params for row in rows]
        # One host-to-device copy for all per-row parameters; top_k is exact in float32 because
        # it is clamped to the vocabulary size first.
        table = torch.tensor(
            [
                [p.temperature, p.min_p, p.top_p, min(p.top_k or vocab_size, vocab_size)]
                for p in params
            ],
            dtype=torch.float32,
        ).to(logits.device, non_blocking=True)
        # Shifting the max to 0 first keeps a tiny temperature from overflowing to inf - inf.
        logits.sub_(logits.amax(dim=-1, keepdim=True)).div_(table[:, 0].unsqueeze(1))
        if any(p.min_p > 0 for p in params):
            apply_min_p(logits, table[:, 1])
        use_top_k = any(0 < p.top_k < vocab_size for p in params)
        use_top_p = any(p.top_p < 1 for p in params)
        if use_top_k or use_top_p:
            logits = apply_top_k_top_p(
                logits,
                table[:, 3].long() if use_top_k else None,
                table[:, 2] if use_top_p else None,
            )
        return logits.softmax(dim=-1)

    @staticmethod
    def race(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One draw per row of `probs` (consumed), from its row's generator where it has one."""
        vocab_size = probs.shape[1]
        # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) picks i with probability p_i.
        q = torch.empty_like(probs)
        shared = [i for i, row in enumerate(rows) if row.generator is None]
        if len(shared) == len(rows):
            q.exponential_()
        elif shared:
            index = torch.tensor(shared, dtype=torch.long, device=probs.device)
            q[index] = torch.empty(len(shared), vocab_size, device=probs.device).exponential_()
        for i, row in enumerate(rows):
            if row.generator is None:
                continue
            if row.generator.device.type == probs.device.type:
                q[i].exponential_(generator=row.generator)
            else:
                # A generator can only fill tensors on its own device: draw there and copy over.
                draw = torch.empty(vocab_size, device=row.generator.device)
                q[i] = draw.exponential_(generator=row.generator).to(probs.device)
        # A q of exactly 0 would turn a masked token's 0/0 into NaN, which argmax would pick.
        q.clamp_(min=torch.finfo(torch.float32).tiny)
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def _fill_logprobs(
        out: list[dict[int, float] | None],
        raw_logprobs: torch.Tensor,
        logprob_rows: list[int],
        sampled: torch.Tensor,
        token_ids: list[int],
        rows: Sequence[SamplingRow],
    ) -> None:
        index = torch.tensor(logprob_rows, dtype=torch.long, device=sampled.device)
        chosen = raw_logprobs.gather(1, sampled[index].unsqueeze(1)).squeeze(1).tolist()
        vocab_size = raw_logprobs.shape[1]
        counts = [min(rows[i].params.logprobs or 0, vocab_size) for i in logprob_rows]
        top_values: list[list[float]] = [[] for _ in logprob_rows]
        top_ids: list[list[int]] = [[] for _ in logprob_rows]
        if max(counts) > 0:
            values, ids = raw_logprobs.topk(max(counts), dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for j, row_id in enumerate(logprob_rows):
            entry = {token_ids[row_id]: chosen[j]}
            for k in range(counts[j]):
                entry[top_ids[j][k]] = top_values[j][k]
            out[row_id] = entry
