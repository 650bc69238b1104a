"""Turns a scheduled batch into tensors, runs the model, and samples.

SchedulerOutput ──▶ input_ids / positions / slot_mapping / block_tables ──▶ CausalLM
                ──▶ logits of the sequences that finished their known tokens ──▶ Sampler
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.config import EngineConfig
from splitserve.engine.cuda_graphs import DecodeGraphs
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.lora.manager import LoRAManager
from splitserve.engine.model import CausalLM
from splitserve.engine.outputs import SampledToken
from splitserve.engine.overlap import PLACEHOLDER, InFlight
from splitserve.engine.parallel.step_plan import StepPlan, StepPlanSink
from splitserve.engine.sampler import Sampler, SamplingRow, plain_greedy_params
from splitserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from splitserve.engine.sequence import Sequence, step_generator
from splitserve.engine.spec_decode.graphs import VerifySteps
from splitserve.engine.spec_decode.verify import verify


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        config: EngineConfig,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_caches = list(kv_cache.layers)
        self.config = config
        self.device = torch.device(config.device)
        self.eos_token_ids = frozenset(model.cfg.eos_token_ids)
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        # Speculative verification over static buffers, by query width (spec_decode/graphs.py).
        self.verify_steps: dict[int, VerifySteps] = {}
        # LoRA adapters (engine/lora), when the engine serves them.
        self.lora: LoRAManager | None = None
        # Host buffers for overlapped steps' tokens, used in turn (engine/overlap.py).
        pin = self.device.type == "cuda"
        self._token_hosts = [
            torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._launches = 0
        # Tensor parallelism, on rank 0: each step's inputs go to the follower ranks first.
        self.step_plans: StepPlanSink | None = None

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs (CUDA only; the attention backend must be graph-safe)."""
        cfg = self.config
        assert cfg.max_model_len is not None
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            max_batch=cfg.max_num_seqs,
            max_blocks_per_seq=-(-cfg.max_model_len // cfg.block_size),
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            lora=self.lora,
        )
        graphs.capture()
        self.graphs = graphs

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs once the GPU is idle. Before a tensor-parallel group is
        released: graphs that captured its collectives keep its communicator in use."""
        if self.graphs is None and not self.verify_steps:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs, self.verify_steps = None, {}
        gc.collect()

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> dict[str, list[SampledToken]]:
        """Run one step; returns the sampled tokens of each sequence that samples."""
        batch = _gather(out, block_tables, self.config.block_size)
        if self.step_plans is not None:
            self.step_plans.send(StepPlan(out.block_copies, **dataclasses.asdict(batch)))
        self.kv_cache.copy_blocks(out.block_copies)
        sampling = [s.seq for s in out.scheduled if s.samples]
        lora_slots = self._begin_lora(out)
        try:
            forward = self._forward(batch, lora_slots)
        finally:
            self._end_lora()
        if forward is None or not sampling:
            return {}
        logits, argmax = forward
        verified: dict[str, list[SampledToken]] = {}
        if any(s.draft_token_ids for s in out.scheduled):
            logits, argmax, sampling, verified = self._verify(out, logits, argmax)
        # A sequence about to fork samples once per sibling from the same logits row.
        row_ids: list[int] = []
        rows: list[SamplingRow] = []
        for i, seq in enumerate(sampling):
            for member in (seq, *seq.pending_children):
                row_ids.append(i)
                rows.append(self._sampling_row(member))
        if len(row_ids) != len(sampling):
            index = torch.tensor(row_ids, device=logits.device)
            logits = logits[index]
            argmax = None if argmax is None else argmax[index]
        result = self.sampler(logits, rows, argmax=argmax)
        sampled: dict[str, list[SampledToken]] = {seq.seq_id: [] for seq in sampling}
        for i, token_id, logprobs in zip(row_ids, result.token_ids, result.logprobs, strict=True):
            sampled[sampling[i].seq_id].append(SampledToken(token_id, logprobs))
        return sampled | verified

    def _verify(
        self, out: SchedulerOutput, logits: torch.Tensor, argmax: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[Sequence], dict[str, list[SampledToken]]]:
        """Verify the speculating sequences' k + 1 rows (engine/spec_decode/verify.py); return
        the other sampling rows (logits, argmax, sequences) and the verified tokens."""
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        plain: list[Sequence] = []
        spec: list[ScheduledSequence] = []
        row = 0
        for item in (s for s in out.scheduled if s.samples):
            num_rows = 1 + len(item.draft_token_ids)
            if item.draft_token_ids:
                spec.append(item)
                spec_rows.extend(range(row, row + num_rows))
            else:
                plain.append(item.seq)
                plain_rows.append(row)
            row += num_rows
        tokens = verify(
            logits[self._to_dev(spec_rows)],
            [s.seq for s in spec],
            [list(s.draft_token_ids) for s in spec],
            self.sampler,
            self._sampling_row,
        )
        verified = {
            item.seq.seq_id: [SampledToken(t) for t in ids]
            for item, ids in zip(spec, tokens, strict=True)
        }
        index = self._to_dev(plain_rows)
        return logits[index], None if argmax is None else argmax[index], plain, verified

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A follower rank's step: rank 0's inputs, the same forward (its collectives pair up
        with rank 0's), no sampling."""
        self.kv_cache.copy_blocks(plan.block_copies)
        fields = dataclasses.asdict(plan)
        del fields["block_copies"]
        self._forward(_Batch(**fields))

    def _forward(
        self, batch: _Batch, lora_slots: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The model on `batch`: (logits of the rows that sample, their argmax when a graph
        computed it), or None when no row samples. `lora_slots`: each row's adapter slot (-1
        for none) when a decode step has adapters (`_begin_lora`)."""
        graphs = self.graphs
        if graphs is not None and batch.is_decode and graphs.can_run(len(batch.query_lens)):
            logits, argmax = graphs.run(
                batch.input_ids, batch.positions, batch.slots, batch.seq_lens, batch.tables,
                lora_slots=lora_slots,
            )  # fmt: skip
            if len(batch.logits_indices) != len(batch.query_lens):
                index = self._to_dev(batch.logits_indices)
                logits, argmax = logits[index], argmax[index]
            return logits, argmax
        verify = self._verify_steps_for(batch, lora_slots)
        if verify is not None:
            logits, token_rows = verify.run(
                batch.input_ids, batch.positions, batch.slots, batch.query_lens,
                batch.seq_lens, batch.tables,
            )  # fmt: skip
            return logits[self._to_dev(token_rows)], None
        hidden = self._forward_eager(batch)
        if not batch.logits_indices:
            return None
        return self.model.compute_logits(hidden[self._to_dev(batch.logits_indices)]), None

    def _verify_steps_for(self, batch: _Batch, lora_slots: list[int] | None) -> VerifySteps | None:
        """The static verification step for a speculative decode batch (every row samples all
        its tokens, none more than a captured width), or None: the eager forward."""
        if (
            not self.verify_steps
            or lora_slots is not None
            or self.step_plans is not None  # NOTE: followers run eagerly, unpadded
            or len(batch.logits_indices) != len(batch.input_ids)
        ):
            return None
        longest = max(batch.query_lens)
        for width in sorted(self.verify_steps):
            steps = self.verify_steps[width]
            if longest <= width:
                return steps if steps.can_run(len(batch.query_lens)) else None
        return None

    def can_overlap(self, out: SchedulerOutput) -> bool:
        """Whether `out` is a decode step whose tokens may stay on the device (`launch`): the
        sampler's plain-greedy case for every row, none about to fork, and none whose blocks
        are watched (a prefill-only sequence's are sent as they are computed)."""
        return all(
            s.num_new_tokens == 1
            and s.samples
            and not (s.seq.pending_children or s.seq.prefill_only or s.seq.grammar)
            and plain_greedy_params(s.seq.params)
            and not self._banned(s.seq)
            for s in out.scheduled
        )

    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]], prev: InFlight | None
    ) -> InFlight:
        """Start a `can_overlap` step without waiting for it. A sequence whose newest token is
        still in flight in `prev` takes it from `prev`'s tokens on the device."""
        # NOTE: followers can't take `prev`'s tokens from rank 0's device: no overlap with TP.
        assert self.step_plans is None, "overlapped steps run at tensor_parallel_size 1 only"
        self.kv_cache.copy_blocks(out.block_copies)
        batch = _gather(out, block_tables, self.config.block_size)
        seqs = [s.seq for s in out.scheduled]
        moves = []
        if prev is not None:
            for row, seq in enumerate(seqs):
                if seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER:
                    moves.append((row, prev.rows[seq]))
                    batch.input_ids[row] = 0  # overwritten on the device
        graphs = self.graphs
        lora_slots = self._begin_lora(out)
        try:
            if graphs is not None and graphs.can_run(len(seqs)):
                carry = (prev.tokens, moves) if prev is not None else None
                _, tokens = graphs.run(
                    batch.input_ids, batch.positions, batch.slots, batch.seq_lens, batch.tables,
                    carry, lora_slots=lora_slots,
                )  # fmt: skip
            else:
                ids = self._to_dev(batch.input_ids)
                if moves:
                    assert prev is not None
                    dst, src = zip(*moves, strict=True)
                    ids[self._to_dev(list(dst))] = prev.tokens[self._to_dev(list(src))]
                hidden = self._forward_eager(batch, ids)
                tokens = self.model.compute_logits(hidden).argmax(dim=-1)
        finally:
            self._end_lora()
        host = self._token_hosts[self._launches % 2][: len(seqs)]
        self._launches += 1
        done = None
        if tokens.device.type == "cuda":
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host.copy_(tokens)
        return InFlight({seq: i for i, seq in enumerate(seqs)}, tokens, host, done)

    def _banned(self, seq: Sequence) -> frozenset[int]:
        """Ids `seq` must not produce this step: EOS and stop ids before `min_tokens`."""
        params = seq.params
        # NOTE: a grammar alone decides where a structured output ends; banning EOS there
        # could leave a row with no allowed token at all.
        if len(seq.output_token_ids) < params.min_tokens and seq.grammar is None:
            return frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else self.eos_token_ids
            )
        return frozenset()

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        return SamplingRow(
            params=seq.params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=step_generator(seq),
            banned_token_ids=self._banned(seq),
            grammar=seq.grammar,
        )

    def _begin_lora(self, out: SchedulerOutput) -> list[int] | None:
        """Put this step's adapters in device slots and describe the batch to the model's LoRA
        layers; returns each row's slot (-1: base model), or None when no row has an adapter
        (the step then runs no LoRA at all)."""
        if self.lora is None:
            return None
        names = [s.seq.lora_name for s in out.scheduled]
        if not any(names):
            return None
        slots = self.lora.begin([s.num_new_tokens for s in out.scheduled], names)
        return [-1 if slot is None else slot for slot in slots]

    def _end_lora(self) -> None:
        if self.lora is not None:
            self.lora.end()

    def _to_dev(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _forward_eager(self, batch: _Batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        width = max(len(t) for t in batch.tables)
        padded = [t + [0] * (width - len(t)) for t in batch.tables]
        cu = [0]
        for n in batch.query_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=self._to_dev(batch.slots),
            cu_seqlens_q=self._to_dev(cu, torch.int32),
            seq_lens=self._to_dev(batch.seq_lens, torch.int32),
            block_tables=self._to_dev(padded, torch.int32),
            query_lens_cpu=tuple(batch.query_lens),
            seq_lens_cpu=tuple(batch.seq_lens),
            block_size=self.config.block_size,
        )
        if input_ids is None:
            input_ids = self._to_dev(batch.input_ids)
        return self.model(input_ids, self._to_dev(batch.positions), self.kv_caches, meta)


@dataclass
class _Batch:
    """One step's inputs as host lists, before they become tensors."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)


def _gather(out: SchedulerOutput, block_tables: dict[str, list[int]], bs: int) -> _Batch:
    batch = _Batch()
    for item in out.scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_new_tokens
        table = block_tables[seq.seq_id]
        drafts = list(item.draft_token_ids)  # speculative: verified after the known tokens
        batch.input_ids.extend(seq.tokens_between(start, end - len(drafts)) + drafts)
        batch.positions.extend(range(start, end))
        batch.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        batch.query_lens.append(item.num_new_tokens)
        batch.seq_lens.append(end)
        batch.tables.append(table)
        if item.samples:  # a speculating sequence samples at each of its k + 1 positions
            first = len(batch.input_ids) - 1 - len(drafts)
            batch.logits_indices.extend(range(first, len(batch.input_ids)))
    return batch
