"""The engine's one handle on speculative decoding: when to speculate and by how much, the
proposer, and the counters vLLM reports (`spec_decode_*`).

NOTE: which sequences may speculate is decided here, in one place: a running sequence with
exactly one token to compute (a decode), no pending fork, not prefill-only, no grammar
(structured outputs decode plainly) and no logprobs. Its K is capped so that no draft lies past
`max_tokens` or the context. A sequence whose drafts keep being rejected sits out a few steps
(spec_decode/backoff.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitserve.engine.outputs import SpeculationUsage
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.spec_decode.backoff import AcceptanceBackoff
from splitserve.engine.spec_decode.config import DEFAULT_MAX_BATCH_SIZE, SpeculativeConfig
from splitserve.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.model import CausalLM
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.outputs import SampledToken
    from splitserve.engine.platform import Platform
    from splitserve.engine.scheduler import SchedulerOutput

_NO_SPECULATION = SpeculationUsage()


@dataclass
class SpecDecodeCounters:
    """Cumulative counts, named as vLLM's `spec_decode_*` metrics."""

    num_drafts: int = 0  # verifications: one per speculating sequence per step
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # drafts accepted (bonus tokens not counted)
    # accepted_per_pos[j]: drafts accepted at position j (0-based) of a proposal
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification (accepted + the one the target adds), vLLM's
        "mean acceptance length"; 0 before any."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


def _first_decode_step(seq: Sequence) -> bool:
    """A sequence's first decode step is a plain one: its second token comes as soon as it
    would without speculation (on a decode worker: the step right after its KV landed, which a
    speculative step would make slower by its draft and wider verification)."""
    return len(seq.output_token_ids) <= 1


class Speculator:
    """Plans, proposes and counts; the scheduler, runner and verifier do the rest."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.backoff = AcceptanceBackoff(config.min_accepted) if config.min_accepted > 0 else None

    def wants(self, batch_size: int) -> bool:
        """Whether a step with `batch_size` running sequences speculates at all."""
        return self.config.num_tokens_for(batch_size) > 0

    def due(self, running: list[Sequence]) -> bool:
        """A new step: whether any of `running` may speculate in it (the batch size's K is not
        0 and some sequence is not sitting out its acceptance backoff). Called once per step."""
        backoff = self.backoff
        if backoff is not None:
            backoff.tick(s.seq_id for s in running)
        if not self.wants(len(running)):
            return False
        ready = [s for s in running if not _first_decode_step(s)]
        return bool(ready) and (backoff is None or any(backoff.due(s.seq_id) for s in ready))

    def plan(self, running: list[Sequence]) -> dict[Sequence, int]:
        """Draft slots per running sequence for the coming step (absent: none)."""
        k = self.config.num_tokens_for(len(running))
        if k == 0:
            return {}
        plan = {}
        backoff = self.backoff
        for seq in running:
            if _first_decode_step(seq):
                continue
            if backoff is not None and not backoff.due(seq.seq_id):
                continue
            room = self._room(seq, k)
            if backoff is not None and backoff.probing(seq.seq_id):
                room = min(room, 1)
            if room > 0:
                n = self.proposer.plan(seq, room)
                if n > 0:
                    plan[seq] = n
        return plan

    def _room(self, seq: Sequence, k: int) -> int:
        params = seq.params
        if (
            seq.status is not SequenceStatus.RUNNING
            or seq.num_uncomputed_tokens != 1
            or seq.pending_children
            or seq.prefill_only
            or seq.grammar is not None
            or params.logprobs is not None
        ):
            return 0
        return min(
            k,
            params.max_tokens - len(seq.output_token_ids) - 1,
            self.max_model_len - seq.num_tokens,
        )

    def propose(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        """Drafts for the scheduled step's speculating sequences (the proposer first sees the
        whole step, and forgets the preempted)."""
        for seq in out.preempted:
            self.proposer.forget(seq)
        self.proposer.observe(out, block_tables)
        items = [s for s in out.scheduled if s.num_spec_tokens]
        if not items:
            return {}
        return self.proposer.propose(items, block_tables)

    def record(self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]]) -> None:
        """Count a verified step (`out` with its drafts attached): each speculating sequence
        emitted its accepted drafts and one more. Counted for the engine and for the sequence
        (its request's `RequestOutput.speculation`)."""
        c = self.counters
        for item in out.scheduled:
            if not item.num_spec_tokens:
                continue
            seq = item.seq
            num_proposed = len(item.draft_token_ids)
            accepted = len(sampled[seq.seq_id]) - 1
            c.num_drafts += 1
            c.num_draft_tokens += num_proposed
            c.num_accepted_tokens += accepted
            if self.backoff is not None:
                self.backoff.record(seq.seq_id, accepted)
            for j in range(accepted):
                c.accepted_per_pos[j] += 1
            usage = seq.speculation or _NO_SPECULATION
            seq.speculation = usage.plus(1, num_proposed, accepted)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        target: CausalLM,
        model_config: ModelConfig,
        platform: Platform,
        asked_num_kv_blocks: int | None,
    ) -> tuple[Speculator, EngineConfig]:
        """The speculator for `config.speculative` (an `EngineConfig`) and the engine config to
        go on with: a draft model's KV pool mirrors the target's blocks, so with a budget (no
        `asked_num_kv_blocks`) both pools share it and the target keeps fewer blocks."""
        from splitserve.engine.spec_decode.proposer import make_proposer

        spec = config.speculative
        assert spec is not None
        if spec.method == "draft" and config.tensor_parallel_size > 1:
            raise ValueError("a draft model is not supported with tensor parallelism yet")
        proposer = make_proposer(spec, target, model_config, config, platform)
        config = proposer.share_kv_budget(config, asked_num_kv_blocks)
        proposer.allocate(config)
        assert config.max_model_len is not None
        return cls(spec, proposer, config.max_model_len), config

    def use_static_steps(self, runner: ModelRunner, capture: bool) -> None:
        """Run verification (and a draft model's proposal) over static buffers per batch
        bucket up to the largest batch that speculates; CUDA graphs of them when `capture`
        (the engine's graphs are on). Off, both run eagerly (engine/spec_decode/graphs.py)."""
        from splitserve.engine.spec_decode.graphs import VerifySteps

        ks = self.config.ks
        cfg = runner.config
        max_len = cfg.max_model_len
        if not ks or max_len is None:
            return
        rows = self.config.k_by_batch_size or ((DEFAULT_MAX_BATCH_SIZE, 1),)
        max_batch = min(cfg.max_num_seqs, max(b for b, k in rows if k > 0))
        cfg = dataclasses.replace(cfg, max_num_seqs=max_batch)
        for k in ks:
            steps = VerifySteps(
                runner.model,
                runner.kv_caches,
                k + 1,
                max_batch=max_batch,
                max_blocks_per_seq=-(-max_len // cfg.block_size),
                block_size=cfg.block_size,
                max_model_len=max_len,
            )
            if capture:
                steps.capture()
            runner.verify_steps[k + 1] = steps
        self.proposer.use_static_steps(cfg, ks, capture)

    def attach(self, out: SchedulerOutput, drafts: dict[str, list[int]]) -> SchedulerOutput:
        """`out` with each speculating sequence's drafts in place."""
        if not drafts:
            return out
        scheduled = []
        for item in out.scheduled:
            if item.num_spec_tokens:
                proposal = drafts[item.seq.seq_id]
                assert len(proposal) == item.num_spec_tokens, "a proposer must fill its slots"
                item = dataclasses.replace(item, draft_token_ids=tuple(proposal))
            scheduled.append(item)
        return dataclasses.replace(out, scheduled=scheduled)

    def stats(self) -> dict[str, Any]:
        """`EngineStats` fields: the `spec_decode_*` counters."""
        c = self.counters
        return {
            "spec_decode_num_drafts": c.num_drafts,
            "spec_decode_num_draft_tokens": c.num_draft_tokens,
            "spec_decode_num_accepted_tokens": c.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(c.accepted_per_pos),
        }
