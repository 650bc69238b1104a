"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Policy only; no tensors. Each step spends a token budget: running sequences first (a decode
costs one token, an unfinished prefill takes the next chunk that fits), then waiting ones in
policy order (FCFS, or priority then arrival). When the KV pool can't hold a running
sequence's next tokens, the lowest-ranked running sequence is preempted: its blocks are freed
and it recomputes later from its tokens, so its output does not change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.outputs import SampledToken
from splitserve.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    # True when this step computes the sequence's last known token, so its logits are sampled.
    samples: bool
    # Draft tokens verified this step (engine/spec_decode): the last `num_spec_tokens` of the
    # `num_new_tokens`, after the sequence's one uncomputed token.
    num_spec_tokens: int = 0
    # The drafts themselves, filled in by the proposer once the step is scheduled.
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    block_copies: tuple[tuple[int, int], ...] = ()
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Tokens computed to fill KV rather than to decode (prompts, recomputes): a sequence's
        # tokens before its `prefill_len`.
        self.num_prefill_tokens = 0

    def _rank(self, seq: Sequence) -> tuple[int, int]:
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.order)
        return (0, seq.order)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting.sort(key=self._rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, spec: Mapping[Sequence, int] | None = None) -> SchedulerOutput:
        """This step's batch. `spec` asks for draft slots per decoding sequence (speculative
        decoding); a sequence gets them only while the budget and free blocks allow."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        self.running.sort(key=self._rank)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            num_spec = min(spec.get(seq, 0), budget - num_new) if spec else 0
            alloc = None
            # NOTE: drafts never preempt: they take slots only while every running sequence
            # could still get a block.
            if num_spec and bm.pool.num_available > len(self.running):
                alloc = bm.allocate(
                    seq.seq_id, seq.num_computed_tokens + num_new + num_spec,
                    num_computed=seq.num_computed_tokens,
                )  # fmt: skip
            if alloc is None:
                num_spec = 0
                alloc = bm.allocate(
                    seq.seq_id, seq.num_computed_tokens + num_new,
                    num_computed=seq.num_computed_tokens,
                )  # fmt: skip
            while alloc is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                alloc = bm.allocate(
                    seq.seq_id, seq.num_computed_tokens + num_new,
                    num_computed=seq.num_computed_tokens,
                )  # fmt: skip
            if alloc is None:
                break
            copies.extend(alloc.copies)
            scheduled.append(self._scheduled(seq, num_new, num_spec))
            budget -= num_new + num_spec
            i += 1

        # NOTE: nothing new is admitted in a step that had to preempt: the pool is full.
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if len(self.running) + 1 + len(seq.pending_children) > self.config.max_num_seqs:
                break
            if not self._adapter_fits(seq):
                break  # its adapter waits for a device slot held by running sequences
            # A prefilled sequence (decode worker) arrives with blocks and computed tokens.
            hit = None
            num_computed = seq.num_computed_tokens
            if not bm.has_seq(seq.seq_id):
                swapped = seq.status is SequenceStatus.PREEMPTED
                hit = bm.find_prefix_hit(seq.token_ids, seq.prefix_root, swapped)
                num_computed = hit.num_tokens(bm.block_size) if hit else 0
            num_new = min(seq.num_tokens - num_computed, budget)
            alloc = bm.allocate(seq.seq_id, num_computed + num_new, hit, num_computed)
            if alloc is None:
                # NOTE: prefilled sequences wait holding their blocks; with nothing running to
                # finish and free some, one of them gives its blocks up (it recomputes later).
                holder = None if self.running else self._waiting_holder(exclude=seq)
                if holder is not None:
                    self.waiting.remove(holder)
                    self._preempt(holder)
                    preempted.append(holder)
                break
            self.waiting.pop(0)
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_prompt_tokens = num_computed
            # NOTE: a prefilled sequence (its KV pushed or handed off) decodes at once
            prefilled = seq.status is SequenceStatus.PREFILLED
            seq.prefill_len = num_computed if prefilled else seq.num_tokens
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            copies.extend(alloc.copies)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, tuple(copies), preempted)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s LoRA adapter can join the running ones: one step never holds more
        distinct adapters than the device has slots (`max_loras`)."""
        if seq.lora_name is None:
            return True
        running = {s.lora_name for s in self.running if s.lora_name is not None}
        return seq.lora_name in running or len(running) < self.config.max_loras

    def _waiting_holder(self, exclude: Sequence) -> Sequence | None:
        """The lowest-ranked waiting sequence that holds blocks, other than `exclude`."""
        holders = [
            s for s in self.waiting if s is not exclude and self.block_manager.has_seq(s.seq_id)
        ]
        return max(holders, key=self._rank) if holders else None

    def _scheduled(self, seq: Sequence, num_new: int, num_spec: int = 0) -> ScheduledSequence:
        start = seq.num_computed_tokens
        self.num_prefill_tokens += max(0, min(start + num_new, seq.prefill_len) - start)
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        return ScheduledSequence(seq, num_new + num_spec, samples, num_spec)

    def _preempt(self, seq: Sequence) -> None:
        bm = self.block_manager
        bm.swap_out(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.prefix_root)
        bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.insert(0, seq)
        self.waiting.sort(key=self._rank)

    def update(
        self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]]
    ) -> list[Sequence]:
        """Apply a step's results: progress, new tokens, forks, token-level stops.

        `sampled[seq_id]` holds one token for the sequence and one for each pending child.
        Returns the sequences that gained a token (finished ones included).
        """
        touched: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            before = seq.num_computed_tokens
            if item.num_spec_tokens:  # engine/spec_decode: verified tokens, then rollback
                touched.append(seq)
                if not self._apply_verified(seq, sampled[seq.seq_id]):
                    continue
            else:
                seq.num_computed_tokens += item.num_new_tokens
            bs = self.block_manager.block_size
            if seq.num_computed_tokens // bs > before // bs:  # a block became full
                self.block_manager.cache_blocks(
                    seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.prefix_root
                )
            if item.samples and not item.num_spec_tokens:
                touched.extend(self._append_samples(seq, sampled[seq.seq_id]))
        return touched

    def _apply_verified(self, seq: Sequence, tokens: list[SampledToken]) -> bool:
        """Append a speculating sequence's verified tokens (accepted drafts, then the target's
        own) up to the first token stop, whose followers are dropped; give back the KV slots
        of rejected drafts. Returns False when the sequence finished.

        NOTE: the slots past the accepted run hold rejected drafts' KV; the block table is
        trimmed to the computed tokens (blocks past them freed) and the rest is overwritten
        by later steps. Only computed, accepted tokens are ever hashed for the prefix cache.
        """
        before = seq.num_computed_tokens
        for token in tokens:
            seq.output_token_ids.append(token.token_id)
            reason = self._stop_reason(seq, token.token_id)
            if reason is not None:
                self.finish(seq, *reason)
                return False
        # The input token and the accepted drafts are computed; the last token is not.
        seq.num_computed_tokens = before + len(tokens)
        self.block_manager.trim(seq.seq_id, seq.num_computed_tokens)
        return True

    def advance(self, out: SchedulerOutput, placeholder: int) -> list[tuple[Sequence, int]]:
        """A launched decode step's sequences count its token as computed and hold `placeholder`
        as the token it samples (engine/overlap.py). Returns them with their computed counts."""
        advanced = []
        for item in out.scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += 1
                seq.output_token_ids.append(placeholder)
                advanced.append((seq, seq.num_computed_tokens))
        return advanced

    def settle(
        self, advanced: list[tuple[Sequence, int]], tokens: dict[Sequence, int]
    ) -> list[Sequence]:
        """Put an advanced step's sampled tokens in place of its placeholders: cache a block that
        became full, apply token stops. Returns the sequences that gained a token, as `update`."""
        touched: list[Sequence] = []
        bm = self.block_manager
        for seq, computed in advanced:
            if seq.is_finished:  # aborted while in flight
                continue
            if computed % bm.block_size == 0 and bm.has_seq(seq.seq_id):
                # NOTE: a full block holds computed tokens only, never the placeholder.
                bm.cache_blocks(seq.seq_id, seq.token_ids, computed, seq.prefix_root)
            # NOTE: what `_append_samples` does, for a plain-greedy sequence (no fork, grammar
            # or logprobs): this runs for every sequence of every overlapped step.
            token = seq.output_token_ids[-1] = tokens[seq]
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, *reason)
            touched.append(seq)
        return touched

    def admit_prefilled(self, seq: Sequence, first_tokens: list[SampledToken]) -> list[Sequence]:
        """Queue a prompt whose KV was computed elsewhere (pushed by a prefill worker) with its
        first sampled token(s); it joins the running batch when `max_num_seqs` and the pool
        allow, like any waiting request. Returns the sequences, as `update`."""
        family = self._append_samples(seq, first_tokens)
        for member in family:
            if member in self.running:  # forked children are placed as running; not yet
                self.running.remove(member)
            if not member.is_finished:
                member.status = SequenceStatus.PREFILLED
                self.waiting.append(member)
        self.waiting.sort(key=self._rank)
        return family

    def _append_samples(self, seq: Sequence, tokens: list[SampledToken]) -> list[Sequence]:
        # The first sample of a request with n > 1 forks it: each sibling shares its blocks.
        family = [seq, *seq.pending_children]
        seq.pending_children = []
        for child in family[1:]:
            child.adopt_progress(seq)
            self.block_manager.fork(seq.seq_id, child.seq_id)
            self.running.append(child)
        for member, token in zip(family, tokens, strict=True):
            member.output_token_ids.append(token.token_id)
            if token.logprobs is not None:
                member.output_logprobs.append(token.logprobs)
            # NOTE: every token reaches the grammar here, the first one sampled on a prefill
            # worker included; a complete grammar ends the sample whatever else holds.
            if member.grammar is not None and member.grammar.advance(token.token_id):
                reason: tuple[FinishReason, int | None] | None = (FinishReason.STOP, None)
            else:
                reason = self._stop_reason(member, token.token_id)
            if reason is not None:
                self.finish(member, *reason)
        return family

    def _stop_reason(self, seq: Sequence, token_id: int) -> tuple[FinishReason, int | None] | None:
        params = seq.params
        if len(seq.output_token_ids) > params.min_tokens:
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP, None
        if (
            seq.prefill_only
            or len(seq.output_token_ids) >= params.max_tokens
            or seq.num_tokens >= self.max_model_len
        ):
            return FinishReason.LENGTH, None
        return None

    def finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Retire a sequence (and its unforked children): free its blocks, drop it from queues."""
        for member in [seq, *seq.pending_children]:
            if member.is_finished:
                continue
            member.status = SequenceStatus.FINISHED
            member.finish_reason = reason
            member.stop_reason = stop_reason
            # NOTE: a finished prefill-only sequence keeps its blocks until their KV is sent.
            if not (member.prefill_only and reason is not FinishReason.ABORT):
                self.block_manager.free(member.seq_id)
            if member in self.running:
                self.running.remove(member)
            if member in self.waiting:
                self.waiting.remove(member)
        seq.pending_children = []
