"""Draft-model proposals: a smaller model guesses K tokens, one forward per token.

The draft is any supported checkpoint sharing the target's vocabulary (`--speculative-model`),
or the target's own first k layers with its final norm and LM head
(`--speculative-draft-layers k`: no extra weights, the modules are shared).

A truncated draft keeps no KV of its own: its layers' keys and values are the target's first
layers' (same weights, tokens and positions), so it attends over the target's pool, and the
prompt KV a decode worker receives (or a prefix hit reuses) serves it as is. It writes only the
slots of this step's positions, which the target's verification then overwrites.

A draft checkpoint's KV pool mirrors the target's: the same number of blocks, indexed by the
target's block tables, so the block manager's rules (allocation, copy-on-write, rollback,
preemption) hold for it unchanged. Per sequence the draft remembers how many leading
positions of its pool are valid; anything past the target's computed tokens is stale (rejected
drafts) and rewritten.

    target computed  |0 ............................. c)  c = tokens with target KV
    draft valid      |0 ..................... v)           v <= c: catch up on [v, c] first
    propose          inputs t[v..c], d1 .. d(k-1)  ->  drafts d1 .. dk (argmax: point masses)

The draft computes a prompt's KV in the steps the target prefills it (chunked prefill too,
`observe`); a request admitted prefilled (a decode worker) or taken from the prefix cache is
caught up in its first speculative step. With static steps on (a CUDA graph per batch bucket
on a GPU, engine/spec_decode/graphs.py) the K proposals are one replay and one read-back.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.kv_cache import KVCache, bytes_per_block
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.spec_decode.graphs import DraftSteps
from splitserve.engine.spec_decode.proposer import Proposer
from splitserve.engine.weights import load_model

if TYPE_CHECKING:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.model import CausalLM
    from splitserve.engine.platform import Platform
    from splitserve.engine.scheduler import ScheduledSequence, SchedulerOutput
    from splitserve.engine.sequence import Sequence
    from splitserve.engine.spec_decode.config import SpeculativeConfig


def truncated_model(target: CausalLM, num_layers: int) -> CausalLM:
    """The target's first `num_layers` layers with its embedding, final norm and LM head,
    sharing their weights (a shallow copy: nothing is duplicated)."""
    if not 1 <= num_layers <= target.cfg.num_layers:
        raise ValueError(
            f"speculative draft_layers must be 1 to {target.cfg.num_layers}, got {num_layers}"
        )
    draft = copy.copy(target)
    draft._modules = dict(target._modules)
    inner = copy.copy(target.model)
    inner._modules = dict(target.model._modules)
    inner.layers = nn.ModuleList(list(target.model.layers)[:num_layers])
    draft.model = inner
    draft.cfg = dataclasses.replace(target.cfg, num_layers=num_layers)
    return draft


# A sequence speculates once its draft lacks at most this many of the target's computed tokens
# (1: after a step whose drafts were all accepted, the last draft): the proposal's first forward
# (or static step) computes them. Further behind, `observe` catches it up first.
MAX_BEHIND = 1


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: CausalLM,
        target_cfg: ModelConfig,
        block_size: int,
        device: str,
        catch_up_tokens: int,
        shares_target_kv: bool = False,
    ):
        self.model = model
        self.catch_up_tokens = catch_up_tokens  # SpeculativeConfig.draft_catch_up_tokens
        # A truncated draft's keys and values ARE the target's first layers' (same weights, same
        # tokens, same positions): it attends over the target's pool, so nothing is duplicated
        # and nothing is ever caught up (prompt chunks, prefix hits, a decode worker's admitted
        # prompt). It writes only slots the target's verification then overwrites.
        self.shares_target_kv = shares_target_kv
        self._kv_layers: list[torch.Tensor] = []
        self.target_cfg = target_cfg  # the target's (this rank's) shape, for the pool split
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_cache: KVCache | None = None
        # seq_id -> (sequence, leading positions whose draft KV is valid)
        self._valid: dict[str, tuple[Sequence, int]] = {}
        self._static: dict[int, DraftSteps] = {}  # by K: proposals over static buffers

    @classmethod
    def build(
        cls,
        config: SpeculativeConfig,
        target: CausalLM,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        platform: Platform,
    ) -> DraftModelProposer:
        if config.model is None:
            assert config.draft_layers is not None
            model = truncated_model(target, config.draft_layers)
            return cls(
                model,
                target.cfg,
                engine_config.block_size,
                engine_config.device,
                config.draft_catch_up_tokens,
                shares_target_kv=True,
            )
        draft_cfg = ModelConfig.from_pretrained(config.model)
        if draft_cfg.vocab_size != model_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_cfg.vocab_size}) is not the "
                f"target's ({model_config.vocab_size}): they must share a tokenizer"
            )
        model = load_model(config.model, draft_cfg, engine_config, platform)
        return cls(
            model,
            target.cfg,
            engine_config.block_size,
            engine_config.device,
            config.draft_catch_up_tokens,
        )

    def plan(self, seq: Sequence, k: int) -> int:
        return k if self._behind(seq) <= MAX_BEHIND else 0

    def catching_up(self, running: list[Sequence]) -> bool:
        return not self.shares_target_kv and any(self._behind(s) > MAX_BEHIND for s in running)

    def share_kv_budget(
        self, config: EngineConfig, asked_num_kv_blocks: int | None
    ) -> EngineConfig:
        if asked_num_kv_blocks is not None or self.shares_target_kv:
            return config  # both pools hold the number of blocks asked for, or one pool
        assert config.num_kv_blocks is not None
        target = bytes_per_block(self.target_cfg, config.block_size, config.cache_dtype)
        draft = bytes_per_block(self.model.cfg, config.block_size, config.cache_dtype)
        blocks = config.num_kv_blocks * target // (target + draft)
        return dataclasses.replace(config, num_kv_blocks=max(1, blocks))

    def allocate(self, config: EngineConfig) -> None:
        if not self.shares_target_kv:
            self.kv_cache = KVCache.allocate(self.model.cfg, config)
            self._kv_layers = list(self.kv_cache.layers)

    def bind_target_kv(self, kv_cache: KVCache) -> None:
        if self.shares_target_kv:
            self._kv_layers = list(kv_cache.layers[: self.model.cfg.num_layers])

    def use_static_steps(self, config: EngineConfig, ks: list[int], capture: bool) -> None:
        assert self._kv_layers and config.max_model_len is not None
        for k in ks:
            steps = DraftSteps(
                self.model,
                self._kv_layers,
                k,
                max_batch=config.max_num_seqs,
                max_blocks_per_seq=-(-config.max_model_len // config.block_size),
                block_size=config.block_size,
                max_model_len=config.max_model_len,
            )
            if capture:
                steps.capture()
            self._static[k] = steps

    def forget(self, seq: Sequence) -> None:
        self._valid.pop(seq.seq_id, None)

    def _behind(self, seq: Sequence) -> int:
        """How many of the target's computed tokens the draft has no KV for."""
        return seq.num_computed_tokens - self._valid_len(seq)

    def _valid_len(self, seq: Sequence) -> int:
        if self.shares_target_kv:
            return seq.num_computed_tokens
        entry = self._valid.get(seq.seq_id)
        valid = entry[1] if entry is not None and entry[0] is seq else self._forked_valid(seq)
        return min(valid, seq.num_computed_tokens)

    def _forked_valid(self, seq: Sequence) -> int:
        """A sample forked off its request's first (n > 1, `Sequence.make_child`: the same
        prompt list) shares its prompt blocks, in the draft's pool as in the target's: the
        draft KV the first sample has for the prompt is the fork's too, until it has its own."""
        first = self._valid.get(f"{seq.request_id}#0")  # the first sample's id (LLMEngine)
        if first is None or first[0] is seq:
            return 0
        if first[0].prompt_token_ids is not seq.prompt_token_ids:
            return 0
        return min(first[1], len(seq.prompt_token_ids))

    @torch.inference_mode()
    def observe(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> None:
        """The step's prompt chunks and plain decodes, run through the draft (its KV only).

        A sequence whose draft is behind (a decode worker's admitted prompt, a prefix-cache
        hit: KV the target did not compute beside the draft) catches up by chunks of at most
        `catch_up_tokens` per step, all such sequences together (or the step's number of target
        tokens, if more: a prefill step keeps pace); its own tokens wait until it is caught up,
        and it decodes plainly meanwhile (`plan`). So no step stalls on a whole prompt."""
        self._valid = {k: v for k, v in self._valid.items() if not v[0].is_finished}
        if self.shares_target_kv:
            return  # the target computes these layers' KV itself
        assert self.kv_cache is not None
        self.kv_cache.copy_blocks(out.block_copies)
        rows = []
        budget = max(self.catch_up_tokens, out.num_batched_tokens)
        for item in out.scheduled:
            # NOTE: a prefill-only sequence (a prefill worker) never decodes here.
            if item.num_spec_tokens or item.seq.prefill_only:
                continue
            seq = item.seq
            end = seq.num_computed_tokens + item.num_new_tokens
            start = self._valid_len(seq)
            behind = seq.num_computed_tokens - start
            if behind > MAX_BEHIND:
                take = min(behind, budget)
                budget -= take
                if take < behind:
                    end = start + take
            if end > start:
                rows.append((seq, seq.tokens_between(start, end), start, block_tables[seq.seq_id]))
        if rows:
            self._forward(rows, want_logits=False)

    @torch.inference_mode()
    def propose(
        self, items: list[ScheduledSequence], block_tables: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        static = self._static_for(items)
        if static is not None:
            return self._propose_static(items, block_tables, static)
        drafts: dict[str, list[int]] = {it.seq.seq_id: [] for it in items}
        # First forward: each sequence's uncomputed-by-the-draft tokens through its last one.
        rows = []
        for it in items:
            seq = it.seq
            start = self._valid_len(seq)
            tokens = seq.tokens_between(start, seq.num_tokens)
            rows.append((seq, tokens, start, block_tables[seq.seq_id]))
        next_ids = self._forward(rows, want_logits=True)
        for it, token in zip(items, next_ids, strict=True):
            drafts[it.seq.seq_id].append(token)
        # Then one draft token per forward, for the sequences that want more.
        for j in range(1, max(it.num_spec_tokens for it in items)):
            live = [it for it in items if it.num_spec_tokens > j]
            rows = [
                (it.seq, [drafts[it.seq.seq_id][-1]], it.seq.num_tokens + j - 1,
                 block_tables[it.seq.seq_id])
                for it in live
            ]  # fmt: skip
            for it, token in zip(live, self._forward(rows, want_logits=True), strict=True):
                drafts[it.seq.seq_id].append(token)
        for it in items:
            # NOTE: positions up to the last draft's input hold KV; what the target rejects
            # is cut off by `_valid_len` (never past the target's computed tokens).
            self._valid[it.seq.seq_id] = (it.seq, it.seq.num_tokens + it.num_spec_tokens - 1)
        return drafts

    def _static_for(self, items: list[ScheduledSequence]) -> DraftSteps | None:
        """The smallest static proposal that covers every item's K, if it fits the batch."""
        k = max(it.num_spec_tokens for it in items)
        for steps_k in sorted(self._static):
            if steps_k >= k:
                steps = self._static[steps_k]
                return steps if steps.can_run(len(items)) else None
        return None

    def _propose_static(
        self,
        items: list[ScheduledSequence],
        block_tables: dict[str, list[int]],
        static: DraftSteps,
    ) -> dict[str, list[int]]:
        """`propose` in one static step (a CUDA graph's replay); a sequence more than 2 tokens
        behind (a prompt the draft never saw) catches up eagerly first."""
        rows = []
        catch_up = []
        for it in items:
            seq = it.seq
            start = self._valid_len(seq)
            tokens = seq.tokens_between(start, seq.num_tokens)
            table = block_tables[seq.seq_id]
            if len(tokens) > 2:
                catch_up.append((seq, tokens[:-1], start, table))
                start, tokens = seq.num_tokens - 1, tokens[-1:]
            rows.append((tokens, start, table, it.num_spec_tokens))
        if catch_up:
            self._forward(catch_up, want_logits=False)
        proposals = static.run(rows)
        for it in items:
            self._valid[it.seq.seq_id] = (it.seq, it.seq.num_tokens + it.num_spec_tokens - 1)
        return {it.seq.seq_id: p for it, p in zip(items, proposals, strict=True)}

    def _forward(
        self, rows: list[tuple[Sequence, list[int], int, list[int]]], want_logits: bool
    ) -> list[int]:
        """Run the draft over (sequence, tokens, first position, block table) rows; record
        the KV it wrote; return each row's argmax after its last token when asked."""
        assert self._kv_layers, "the draft's KV pool is not bound"
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        last: list[int] = []
        for seq, tokens, start, table in rows:
            end = start + len(tokens)
            ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(end)
            last.append(len(ids) - 1)
            self._valid[seq.seq_id] = (seq, end)
        width = max(len(r[3]) for r in rows)
        tables = [r[3] + [0] * (width - len(r[3])) for r in rows]
        meta = AttentionMetadata(
            slot_mapping=self._dev(slots),
            cu_seqlens_q=self._dev(cu, torch.int32),
            seq_lens=self._dev(seq_lens, torch.int32),
            block_tables=self._dev(tables, torch.int32),
            query_lens_cpu=tuple(len(r[1]) for r in rows),
            seq_lens_cpu=tuple(seq_lens),
            block_size=bs,
        )
        hidden = self.model(self._dev(ids), self._dev(positions), self._kv_layers, meta)
        if not want_logits:
            return []
        logits = self.model.compute_logits(hidden[self._dev(last)])
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    def _dev(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
