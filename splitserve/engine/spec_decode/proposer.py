"""The proposer interface: what guesses a speculating sequence's next tokens, and its factory.

A step with speculation runs in this order (engine/llm_engine.py):

    plan (before scheduling: how many draft slots each running sequence wants)
      -> Scheduler.schedule (1 + k slots for a speculating sequence, in its block table)
      -> observe (the step's other work, so a draft model's KV keeps up) and propose (exactly
         k drafts per speculating sequence; a draft model writes its KV into those slots)
      -> ModelRunner.execute (one target forward over the k + 1 positions; verification)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.model import CausalLM
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.platform import Platform
    from splitserve.engine.scheduler import ScheduledSequence, SchedulerOutput
    from splitserve.engine.sequence import Sequence
    from splitserve.engine.spec_decode.config import SpeculativeConfig


class Proposer(ABC):
    """Proposes draft tokens; the target verifies them, so a bad guess costs speed, never
    correctness. Every draft is a point mass (a deterministic guess): verification accepts it
    with the target's probability of it (engine/spec_decode/verify.py)."""

    @abstractmethod
    def plan(self, seq: Sequence, k: int) -> int:
        """How many draft slots (0..k) `seq` asks for this step; called before scheduling."""

    @abstractmethod
    def propose(
        self, items: list[ScheduledSequence], block_tables: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        """Exactly `item.num_spec_tokens` drafts for each item, by sequence id. The items'
        block tables already hold slots for their drafts."""

    def observe(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> None:  # noqa: B027
        """See every step before the target's forward (a draft model computes the KV of the
        step's prompt chunks and plain decodes with it). Nothing by default."""

    def catching_up(self, running: list[Sequence]) -> bool:
        """Whether `observe` is still catching up on some of `running` (such a step must not
        be overlapped: an overlapped step is not observed). False by default."""
        return False

    def forget(self, seq: Sequence) -> None:  # noqa: B027
        """`seq` finished or was preempted: drop what is kept for it. Nothing by default."""

    def share_kv_budget(
        self, config: EngineConfig, asked_num_kv_blocks: int | None
    ) -> EngineConfig:
        """The target's engine config once this proposer's own KV pool has its share of the
        memory budget (unchanged by default: no pool of its own)."""
        return config

    def allocate(self, config: EngineConfig) -> None:  # noqa: B027
        """Allocate what this proposer keeps on the device (its KV pool) for `config`."""

    def bind_target_kv(self, kv_cache: KVCache) -> None:  # noqa: B027
        """The target's KV pool, once allocated (a draft that shares it attends over it)."""

    def use_static_steps(self, config: EngineConfig, ks: list[int], capture: bool) -> None:  # noqa: B027
        """Propose over static buffers for proposals of up to each K in `ks` (CUDA graphs
        captured when `capture`; engine/spec_decode/graphs.py). Nothing by default."""


def make_proposer(
    config: SpeculativeConfig,
    target: CausalLM,
    model_config: ModelConfig,
    engine_config: EngineConfig,
    platform: Platform,
) -> Proposer:
    """The proposer `config.method` names."""
    if config.method == "ngram":
        from splitserve.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max)
    from splitserve.engine.spec_decode.draft import DraftModelProposer

    return DraftModelProposer.build(config, target, model_config, engine_config, platform)
