"""One sequence of tokens that the scheduler moves through its states.

A request with `n > 1` starts as one sequence; when its prompt is computed it is forked into
`n` siblings that share the prompt's blocks (see BlockManager.fork).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """Tokens, progress and status of one generated continuation.

    NOTE: `num_computed_tokens` counts tokens whose KV is in the cache; the tokens still to
    compute are `token_ids[num_computed_tokens:]` — the prompt (possibly in chunks), then one
    sampled token per decode step. Preemption only resets it to 0 (recompute).
    """

    seq_id: str
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    priority: int = 0
    index: int = 0  # which of the request's n samples this is
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    # Siblings (n > 1) not yet forked off: the first sampled token fans out to them, each drawn
    # with its own generator, and they then share this sequence's blocks.
    pending_children: list[Sequence] = field(default_factory=list)
    order: int = field(default_factory=itertools.count().__next__)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def make_child(self, index: int) -> Sequence:
        """A sibling for sample `index` of the same request, to be forked off later."""
        return Sequence(
            seq_id=f"{self.request_id}#{index}",
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            arrival=self.arrival,
            priority=self.priority,
            index=index,
            generator=make_generator(self.params, index),
        )

    def adopt_progress(self, parent: Sequence) -> None:
        """Take over the parent's computed state at the moment of the fork."""
        self.output_token_ids = list(parent.output_token_ids)
        self.output_logprobs = list(parent.output_logprobs)
        self.num_computed_tokens = parent.num_computed_tokens
        self.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        self.status = parent.status


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """A per-sequence RNG so that a seeded request samples the same whatever it is batched with."""
    if params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed((params.seed * 1_000_003 + index) % 2**64)
    return gen
