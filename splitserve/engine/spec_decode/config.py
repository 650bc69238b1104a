"""`SpeculativeConfig`: how a worker speculates (which proposer, how many tokens, when to stop).

Frozen and torch-free: `EngineConfig.speculative` holds one, and the workers build it from
their `--speculative-*` flags.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")

DEFAULT_MAX_BATCH_SIZE = 32
"""Without a table, speculation runs up to this many running sequences and is off above it:
a decode step's weight read is shared by the whole batch there, so verifying K extra tokens per
sequence stops being free (published gains shrink to none by batch 128-256)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    Attributes:
        method: "ngram" (prompt lookup: no extra model) or "draft" (a smaller model).
        num_speculative_tokens: K, the most tokens proposed per sequence per step.
        model: the draft checkpoint's directory (method "draft"); it must share the target's
            tokenizer (vocabulary).
        draft_layers: with no `model`, the draft is the target's first `draft_layers` layers
            with its final norm and LM head (no extra weights).
        ngram_max / ngram_min: the longest / shortest suffix n-gram looked up (method "ngram").
        k_by_batch_size: rows (max running sequences, K) in ascending order: a step with B
            running sequences proposes the K of the first row whose bound is >= B, and nothing
            above the last row. None: `((DEFAULT_MAX_BATCH_SIZE, num_speculative_tokens),)`.
        min_accepted: a sequence whose mean accepted drafts per verification falls below
            this sits out speculation for a while, probing again after 2, 4, ... 64 steps
            (spec_decode/backoff.py), so hopeless drafts cost little; 0 turns that off.
        cuda_graphs: whether the draft's proposal and the target's verification replay CUDA
            graphs (per batch bucket) when the engine captures graphs; off: they run eagerly.
        draft_catch_up_tokens: a draft checkpoint (`model`) computes at most this many (or, in
            a step with more target tokens, that many) prompt tokens per step that the target
            did not compute beside it: a decode worker's admitted prompt, a prefix-cache hit.
            A sequence decodes plainly while its draft is behind, so the catch-up is spread
            over steps instead of stalling one (engine/spec_decode/draft.py).
    """

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None
    draft_layers: int | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    k_by_batch_size: tuple[tuple[int, int], ...] | None = None
    min_accepted: float = 0.5
    cuda_graphs: bool = True
    draft_catch_up_tokens: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method must be one of {list(METHODS)}, got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.method == "draft":
            if (self.model is None) == (self.draft_layers is None):
                raise ValueError(
                    "speculative method 'draft' needs exactly one of a draft model directory "
                    "(--speculative-model) or a number of target layers "
                    "(--speculative-draft-layers)"
                )
            if self.draft_layers is not None and self.draft_layers < 1:
                raise ValueError("speculative draft_layers must be at least 1")
        elif self.model is not None or self.draft_layers is not None:
            raise ValueError(
                "--speculative-model and --speculative-draft-layers need method 'draft'"
            )
        if self.draft_catch_up_tokens < 1:
            raise ValueError("draft_catch_up_tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if not 0 <= self.min_accepted <= self.num_speculative_tokens:
            raise ValueError("min_accepted must be in [0, num_speculative_tokens]")
        rows = self.k_by_batch_size
        if rows is not None:
            bounds = [b for b, _ in rows]
            if bounds != sorted(set(bounds)) or any(b < 1 for b in bounds):
                raise ValueError("k_by_batch_size bounds must be ascending and >= 1")
            if any(not 0 <= k <= self.num_speculative_tokens for _, k in rows):
                raise ValueError("k_by_batch_size K values must be in [0, num_speculative_tokens]")

    @property
    def ks(self) -> list[int]:
        """Every K a step may propose (ascending, none 0)."""
        rows = self.k_by_batch_size
        if rows is None:
            return [self.num_speculative_tokens]
        return sorted({k for _, k in rows if k > 0})

    def num_tokens_for(self, batch_size: int) -> int:
        """K for a step with `batch_size` running sequences (0: no speculation)."""
        rows = self.k_by_batch_size
        if rows is None:
            rows = ((DEFAULT_MAX_BATCH_SIZE, self.num_speculative_tokens),)
        for bound, k in rows:
            if batch_size <= bound:
                return k
        return 0
