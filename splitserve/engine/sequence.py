"""One sequence of tokens that the scheduler moves through its states.

A request with `n > 1` starts as one sequence; when its prompt is computed it is forked into
`n` siblings that share the prompt's blocks (see BlockManager.fork).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitserve.engine.errors import InvalidRequest
from splitserve.engine.outputs import Resume, SpeculationUsage
from splitserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLED = "prefilled"  # its prompt KV was computed elsewhere; waits for a batch slot
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
    # Tokens to compute before it decodes, set as it joins the batch: its prompt (and resumed
    # tokens, after a preemption or a resume), or none when its KV came from elsewhere.
    prefill_len: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Siblings (n > 1) not yet forked off: the first sampled token fans out to them, and they
    # then share this sequence's blocks.
    pending_children: list[Sequence] = field(default_factory=list)
    # A prefill-only sequence (on a prefill worker) stops after its first token and keeps its
    # blocks until the engine is told they have been sent.
    prefill_only: bool = False
    # Where a structured output's sample is in its grammar; None for free text.
    grammar: GrammarState | None = None
    # The LoRA adapter this sequence runs under (None: the base model), and the root its
    # prefix-cache block hashes chain from (engine/lora).
    lora_name: str | None = None
    prefix_root: bytes | None = None
    # Its speculative decoding so far (engine/spec_decode/speculator.py); None: none verified.
    speculation: SpeculationUsage | None = None
    order: int = field(default_factory=itertools.count().__next__)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step needs one)."""
        split = len(self.prompt_token_ids)
        if start >= split:
            return self.output_token_ids[start - split : end - split]
        if end <= split:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - split]

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
            prefill_only=self.prefill_only,
            lora_name=self.lora_name,
            prefix_root=self.prefix_root,
        )

    def adopt_progress(self, parent: Sequence) -> None:
        """Take over the parent's computed state at the moment of the fork."""
        self.output_token_ids = list(parent.output_token_ids)
        self.output_logprobs = list(parent.output_logprobs)
        self.num_computed_tokens = parent.num_computed_tokens
        self.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        self.status = parent.status

    def resume(self, resume: Resume, vocab_size: int) -> None:
        """Make this new sequence a sample whose stream broke off elsewhere: its tokens count
        as generated (penalties, min/max_tokens, the seeded draws' position) and their KV is
        recomputed, as after a preemption."""
        bad = [t for t in resume.output_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(
                f"resumed tokens outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )
        if len(resume.output_token_ids) >= self.params.max_tokens:
            raise InvalidRequest(
                f"resumed after {len(resume.output_token_ids)} tokens, but max_tokens is "
                f"{self.params.max_tokens}: nothing is left to generate"
            )
        self.index = resume.sample_index
        self.output_token_ids = list(resume.output_token_ids)
        if self.params.logprobs is not None:
            # NOTE: placeholders keep logprobs aligned with tokens; they are never sent again.
            self.output_logprobs = [{t: 0.0} for t in resume.output_token_ids]
        self.status = SequenceStatus.PREEMPTED


def step_generator(seq: Sequence) -> torch.Generator | None:
    """The RNG for a seeded sequence's next token, keyed by (seed, sample index, position).

    NOTE: keyed rather than carried along, so a seeded request samples the same tokens whatever
    it is batched with, after a preemption, and when its first token is drawn on a prefill
    worker and the rest on a decode worker.
    """
    if seq.params.seed is None:
        return None
    gen = torch.Generator()
    key = (seq.params.seed * 1_000_003 + seq.index) * 1_000_003 + len(seq.output_token_ids)
    gen.manual_seed(key % 2**64)
    return gen
