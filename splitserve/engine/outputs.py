"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One of a request's `n` samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    # The stop token id or stop string that ended it (None for EOS or length).
    stop_reason: int | str | None = None
    # Per generated token: token id -> logprob (the sampled token plus the top-n), if asked.
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: cumulative text and tokens of each sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # What speculative decoding did for the request so far (all its samples); None while no
    # draft of it has been verified (no speculation, or none yet).
    speculation: SpeculationUsage | None = None


@dataclass(frozen=True)
class SpeculationUsage:
    """One request's speculative decoding, counted as the engine's `spec_decode_*` metrics."""

    num_drafts: int = 0  # verifications: one per speculating step of each sample
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # drafts accepted (the token the target adds not counted)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the one the target adds), vLLM's
        "mean acceptance length"; 0 before any verification."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    def plus(
        self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int
    ) -> SpeculationUsage:
        return SpeculationUsage(
            self.num_drafts + num_drafts,
            self.num_draft_tokens + num_draft_tokens,
            self.num_accepted_tokens + num_accepted_tokens,
        )


@dataclass(frozen=True)
class SampledToken:
    """One sampled token (and its logprobs, when asked for)."""

    token_id: int
    logprobs: dict[int, float] | None = None


@dataclass(frozen=True)
class Resume:
    """Sample `sample_index` of a request whose stream broke off elsewhere after
    `output_token_ids`: it goes on as the worker that began it would have gone on."""

    sample_index: int
    output_token_ids: tuple[int, ...]


def handoff_kv_tokens(num_prompt_tokens: int, num_resumed_tokens: int) -> int:
    """Leading tokens whose KV a resumed sample needs handed to its new worker: all but the last
    token it has (the last is its next input; engine/parking.py)."""
    return num_prompt_tokens + num_resumed_tokens - 1
