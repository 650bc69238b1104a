"""Turns a scheduled batch into tensors, runs the model, and samples.

SchedulerOutput ──▶ input_ids / positions / slot_mapping / block_tables ──▶ CausalLM
                ──▶ logits of the sequences that finished their known tokens ──▶ Sampler
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.kv_cache import copy_blocks
from engine.model import CausalLM
from engine.sampler import Sampler, SamplingRow
from engine.scheduler import SampledToken, SchedulerOutput
from engine.sequence import Sequence, step_generator


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        config: EngineConfig,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.config = config
        self.device = torch.device(config.device)
        self.eos_token_ids = frozenset(model.cfg.eos_token_ids)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> dict[str, list[SampledToken]]:
        """Run one step; returns the sampled tokens of each sequence that samples."""
        copy_blocks(self.kv_caches, out.block_copies)
        input_ids, positions, meta, logits_indices = self._prepare(out, block_tables)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampling = [s.seq for s in out.scheduled if s.samples]
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[logits_indices])
        # A sequence about to fork samples once per sibling from the same logits row.
        row_ids: list[int] = []
        rows: list[SamplingRow] = []
        for i, seq in enumerate(sampling):
            for member in (seq, *seq.pending_children):
                row_ids.append(i)
                rows.append(self._sampling_row(member))
        if len(row_ids) != len(sampling):
            logits = logits[torch.tensor(row_ids, device=logits.device)]
        result = self.sampler(logits, rows)
        sampled: dict[str, list[SampledToken]] = {seq.seq_id: [] for seq in sampling}
        for i, token_id, logprobs in zip(row_ids, result.token_ids, result.logprobs, strict=True):
            sampled[sampling[i].seq_id].append(SampledToken(token_id, logprobs))
        return sampled

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.params
        banned: frozenset[int] = frozenset()
        if len(seq.output_token_ids) < params.min_tokens:
            banned = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else self.eos_token_ids
            )
        return SamplingRow(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=step_generator(seq),
            banned_token_ids=banned,
        )

    def _prepare(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        for item in out.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = block_tables[seq.seq_id]
            input_ids.extend(seq.tokens_between(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            tables.append(table)
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)

        def to_dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=to_dev(slots, torch.int64),
            cu_seqlens_q=to_dev(cu, torch.int32),
            seq_lens=to_dev(seq_lens, torch.int32),
            block_tables=to_dev(padded, torch.int32),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
            block_size=bs,
        )
        return (
            to_dev(input_ids, torch.int64),
            to_dev(positions, torch.int64),
            meta,
            to_dev(logits_indices, torch.int64),
        )
