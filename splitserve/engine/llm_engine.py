"""The engine loop: requests in, one scheduled step at a time, outputs out.

add_request ──▶ Scheduler.schedule ──▶ ModelRunner.execute (model + sampler)
            ──▶ Scheduler.update (tokens, forks, token stops)
            ──▶ OutputProcessor (text, stop strings) ──▶ RequestOutput
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

from splitserve.engine.block_manager import BlockManager, KVUsage
from splitserve.engine.config import EngineConfig
from splitserve.engine.disaggregation import CapacityError as CapacityError
from splitserve.engine.disaggregation import DisaggregationMixin
from splitserve.engine.disaggregation import Reservation as Reservation
from splitserve.engine.errors import AlreadyExists, Cancelled
from splitserve.engine.grammar import Grammars
from splitserve.engine.host_tier import HostTier, host_index
from splitserve.engine.kv_cache import KVCache, fit_context_to_pool, size_kv_pool
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.lora.engine_mixin import LoRAEngineMixin
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.mla import check_engine as check_mla_engine
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.output_processor import OutputProcessor, RequestState
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.overlap import PLACEHOLDER, InFlight
from splitserve.engine.parallel.follower import agree_on_kv_pool
from splitserve.engine.parallel.kv_shards import ShardedKVConnector
from splitserve.engine.parallel.launcher import Followers
from splitserve.engine.parallel.sharding import check_divisible
from splitserve.engine.parking import ParkingMixin
from splitserve.engine.platform import Platform
from splitserve.engine.request_checks import Prompt, check_request, prompt_token_ids
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import FinishReason, Sequence
from splitserve.engine.spec_decode.speculator import Speculator
from splitserve.engine.stats import EngineStats
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.engine.weights import load_model
from splitserve.engine.window_slots import WindowSlots


class LLMEngine(LoRAEngineMixin, DisaggregationMixin, ParkingMixin):
    """Owns the model, the KV pool, the scheduler and the request states of one worker."""

    config: EngineConfig  # as asked, with the pool sized (`_load`) and the context fitted
    kv_cache: KVCache

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.model_config = ModelConfig.from_pretrained(model_dir)
        asked_len = config.max_model_len
        max_len = asked_len or self.model_config.max_model_len
        if max_len > self.model_config.max_model_len:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's {self.model_config.max_model_len}"
            )
        self.platform = Platform.resolve(config)
        self.platform.activate()
        config = self.platform.apply(dataclasses.replace(config, max_model_len=max_len))
        check_mla_engine(self.model_config, config)  # what DeepSeek's MLA cannot run with yet
        self.tokenizer = load_tokenizer(model_dir)
        mc = self.model_config
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, mc.eos_token_ids)
        # Tensor parallelism: this engine is rank 0; its followers shard the model with it.
        self.followers: Followers | None = None
        if config.tensor_parallel_size > 1:
            check_divisible(mc, config.tensor_parallel_size)
            self.followers = Followers.start(model_dir, config)
        try:
            self._load(model_dir, config)
        except BaseException:
            self.shutdown()
            raise
        self.speculator = self._start_speculation(config)
        if asked_len is None:
            self.config = fit_context_to_pool(self.config)
            max_len = self.max_model_len
        assert self.config.num_kv_blocks is not None
        tp = self.followers is not None
        host = host_index(self.config.kv_host_cache_bytes, self.kv_cache, tp)
        if host is not None and self.config.record_prefix_events:
            host.record_events()  # the host tier is published beside the GPU prefix cache
        self.block_manager = BlockManager(
            self.config.num_kv_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            self.config.record_prefix_events,
            window=self._window_slots(),
            host=host,
        )
        self.host_tier = (
            HostTier(self.kv_cache.pool, self.block_manager.host)
            if self.block_manager.host is not None
            else None
        )
        self.scheduler = Scheduler(
            self.config, self.block_manager, max_len, self.model_config.eos_token_ids
        )
        self.kv_connector = (
            KVConnector(self.kv_cache, self.block_manager, self.config.block_size)
            if self.followers is None
            else ShardedKVConnector(
                self.kv_cache, self.block_manager, self.config.block_size, self.followers, mc
            )
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.config)
        if self.followers is not None:
            self.runner.step_plans = self.followers
        self.runner.lora = self.lora
        if self.platform.cuda_graphs:
            self.runner.capture_cuda_graphs()
            # NOTE: not with tensor parallelism: a capture's collectives need the followers.
            spec = self.speculator
            if spec is not None and spec.config.cuda_graphs and self.followers is None:
                spec.use_static_steps(self.runner, capture=True)
        self.outputs = OutputProcessor(self.tokenizer, self.config.stream_text)
        self._reserved: dict[str, Sequence] = {}
        self._parked: dict[str, Sequence] = {}  # streams moved away, KV kept (engine/parking.py)
        self._sent_prefills: list[str] = []  # watched prefills whose last blocks are pinned
        overlap = self.config.async_scheduling
        self.overlap = self.platform.cuda_graphs if overlap is None else overlap
        self.overlap = self.overlap and self.followers is None  # NOTE: model_runner.launch
        self._inflight: InFlight | None = None  # a decode step launched, not yet settled
        self._spec_due = False  # speculation was due when a step in flight had to settle first
        self._ids = itertools.count()

    def _load(self, model_dir: str | Path, config: EngineConfig) -> None:
        """This rank's model and KV cache (the whole model without tensor parallelism)."""
        group = self.followers.group if self.followers is not None else None
        self.model = load_model(model_dir, self.model_config, config, self.platform, group)
        # NOTE: LoRA's device slots before the KV pool is sized from what memory is left.
        self.lora = self._start_lora(config)
        local = self.model.cfg  # this rank's heads: its KV cache holds only those
        if group is not None:
            self.config = agree_on_kv_pool(local, config, self.platform, group)
        else:
            self.config = size_kv_pool(local, config, self.platform.kv_cache_budget(config))
        self.kv_cache = KVCache.allocate(local, self.config)
        self.model.window_map = self.kv_cache.window_map

    def _window_slots(self) -> WindowSlots | None:
        """The sliding layers' slots when their KV has a pool of its own (engine/kv_cache.py)."""
        if self.kv_cache.window_pool is None:
            return None
        window = self.model_config.sliding_window
        assert window is not None and self.config.num_window_slots is not None
        return WindowSlots(self.config.num_window_slots, window, self.config.block_size)

    def shutdown(self) -> None:
        """Stop this engine's other tensor-parallel ranks (idempotent; nothing at TP=1)."""
        if self.followers is not None:
            self.runner.release_cuda_graphs()
            self.followers.shutdown()

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        prefill_only: bool = False,
        lora_request: LoRARequest | str | None = None,
    ) -> str:
        """Validate and queue a request; raise InvalidRequest on bad input before any work is done.

        A `prefill_only` request (prefill workers) stops after its first token; its blocks are
        reported through `kv_connector` when the service `watch`es it. `lora_request` names
        the LoRA adapter it runs under (NotFound if not loaded and no path is given).
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        text, token_ids = prompt_token_ids(self.tokenizer, prompt)
        lora = self._resolve_lora(lora_request)
        root = self._new_request(request_id, text, token_ids, params, priority)
        for member in (root, *root.pending_children):
            member.prefill_only = prefill_only
            member.lora_name, member.prefix_root = lora
        self.scheduler.add(root)
        return request_id

    def _new_sequence(
        self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> Sequence:
        """A request's first sequence, after checking its id is free and its input is valid."""
        if self.has_request(request_id):
            raise AlreadyExists(f"request id {request_id!r} is already in use")
        self._validate(token_ids, params)
        return Sequence(
            seq_id=f"{request_id}#0",
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            params=params,
            arrival=time.monotonic(),
            priority=priority,
        )

    def _new_request(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
    ) -> Sequence:
        root = self._new_sequence(request_id, token_ids, params, priority)
        root.pending_children = [root.make_child(i) for i in range(1, params.n)]
        self.grammars.attach([root, *root.pending_children], params.structured)
        self.outputs.add(RequestState(request_id, text, token_ids, [root, *root.pending_children]))
        return root

    def _forget(self, request_id: str) -> None:
        """Drop a finished request; free blocks a prefill-only one still held (blocks pinned
        for a transfer stay pinned)."""
        state = self.outputs.requests.pop(request_id, None)
        if state is not None:
            for seq in state.sequences:
                self.block_manager.free(seq.seq_id)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        assert self.config.num_kv_blocks is not None
        check_request(
            token_ids,
            params,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            num_kv_blocks=self.config.num_kv_blocks,
            block_size=self.config.block_size,
            grammars=self.grammars,
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is (reserved, queued, running, held for sending, or parked)
        and free its blocks. Returns False for an unknown id."""
        if self._drop_parked(request_id):
            return True
        reserved = self._reserved.pop(request_id, None)
        if reserved is not None:
            self.block_manager.free(reserved.seq_id)
            return True
        state = self.outputs.requests.get(request_id)
        if state is None:
            return False
        for seq in state.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
            self.block_manager.free(seq.seq_id)  # a held prefill-only sequence
        self.outputs.pop(request_id)
        self.kv_connector.fail(request_id, Cancelled(f"request {request_id!r} was aborted"))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_running_seqs(self) -> int:
        """Sequences in the running batch (the next step decodes or extends them)."""
        return len(self.scheduler.running)

    def num_requests(self) -> int:
        """Requests known in any state: reserved, queued, running, held for sending, parked."""
        return len(self.outputs.requests) + len(self._reserved) + len(self._parked)

    def has_request(self, request_id: str) -> bool:
        return any(request_id in r for r in (self.outputs.requests, self._reserved, self._parked))

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of the requests that gained tokens.

        With `async_scheduling`, a plain-greedy decode step is left in flight and its outputs
        come with the next call's (engine/overlap.py)."""
        self.housekeeping()
        prev, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        plan: dict[Sequence, int] = {}
        observe = False
        due, self._spec_due = self._spec_due, False
        if not due and self.speculator is not None:
            due = self.speculator.due(self.scheduler.running)  # NOTE: one backoff tick a step
        if due:
            assert self.speculator is not None
            # NOTE: proposals need every token known: no overlap while speculation is on. The
            # step in flight settles and its tokens go out now (a just-admitted request's
            # second token waits for no draft); the speculative step runs on the next call.
            if prev is not None:
                outputs, self._spec_due = self._settle(prev), True
                self._sent_prefills += self.kv_connector.after_step(self._prompt_progress)
                return outputs
            plan = self.speculator.plan(self.scheduler.running)
            # NOTE: a draft catching up on sequences that decode plainly meanwhile must see
            # this step, which an overlapped one skips.
            observe = not plan and self.speculator.proposer.catching_up(self.scheduler.running)
        out = self.scheduler.schedule(plan) if plan else self.scheduler.schedule()
        if out.is_empty and prev is None:
            return outputs
        overlap = self.overlap and not observe and not out.is_empty and self.runner.can_overlap(out)
        if prev is not None and not overlap:
            outputs = self._settle(prev)
            prev = None
            out = dataclasses.replace(
                out, scheduled=[s for s in out.scheduled if not s.seq.is_finished]
            )
        if not out.is_empty:
            bm = self.block_manager
            tables = {s.seq.seq_id: bm.block_table(s.seq.seq_id) for s in out.scheduled}
            if bm.window is not None:  # NOTE: stream-ordered after any step in flight
                self.kv_cache.apply_window_changes(bm.window.drain_changes())
            if self.host_tier is not None and bm.host is not None:
                if self.host_tier.saves_landed():
                    bm.host.saves_done()
                self.host_tier.run(bm.host.drain())
            if overlap:
                launched = self.runner.launch(out, tables, prev)
                if prev is not None:
                    outputs = self._settle(prev)
                launched.advanced = self.scheduler.advance(out, PLACEHOLDER)
                self._inflight = launched
            else:
                drafts: dict[str, list[int]] = {}
                if self.speculator is not None:
                    drafts = self.speculator.propose(out, tables)
                    out = self.speculator.attach(out, drafts)
                sampled = self.runner.execute(out, tables)
                if drafts:
                    self.speculator.record(out, sampled)  # type: ignore[union-attr]
                outputs += self._process_outputs(self.scheduler.update(out, sampled))
        # NOTE: a watched prefill that finished is forgotten (its unpinned blocks freed) on the
        # next turn, not now: step hooks still see its final progress after this step.
        self._sent_prefills += self.kv_connector.after_step(self._prompt_progress)
        if len(outputs) > 1:  # a request settled from the step in flight and stepped again
            outputs = list({o.request_id: o for o in outputs}.values())
        return outputs

    def _start_speculation(self, asked: EngineConfig) -> Speculator | None:
        """The speculator `config.speculative` asks for (a draft model's KV pool takes its share
        of the memory budget, unless `num_kv_blocks` was given)."""
        if self.config.speculative is None:
            return None
        speculator, self.config = Speculator.start(
            self.config, self.model, self.model_config, self.platform, asked.num_kv_blocks
        )
        if getattr(self, "kv_cache", None) is not None and (
            self.kv_cache.num_blocks != self.config.num_kv_blocks
        ):
            del self.kv_cache  # NOTE: freed before the smaller pool is allocated
            self.kv_cache = KVCache.allocate(self.model.cfg, self.config)
        if getattr(self, "kv_cache", None) is not None:
            speculator.proposer.bind_target_kv(self.kv_cache)
        return speculator

    def _settle(self, inflight: InFlight) -> list[RequestOutput]:
        """Wait for a step left in flight and apply its tokens."""
        touched = self.scheduler.settle(inflight.advanced, inflight.token_ids())
        return self._process_outputs(touched)

    def housekeeping(self) -> None:
        """Work that must not wait for the next step (the engine may be idle): unpin blocks
        whose transfer was acknowledged, forget prefills whose blocks all went out."""
        self.kv_connector.drain_releases()
        sent, self._sent_prefills = self._sent_prefills, []
        for request_id in sent:
            state = self.outputs.requests.get(request_id)
            if state is not None and all(seq.is_finished for seq in state.sequences):
                self._forget(request_id)

    def _process_outputs(self, touched: list[Sequence]) -> list[RequestOutput]:
        for hit in self.outputs.detokenize(touched):
            if hit.seq.is_finished:
                hit.seq.finish_reason = FinishReason.STOP
                hit.seq.stop_reason = hit.stop
            else:
                self.scheduler.finish(hit.seq, FinishReason.STOP, hit.stop)
        results = []
        requests = self.outputs.requests
        for request_id in dict.fromkeys(seq.request_id for seq in touched):
            if not (self.config.stream_text or requests[request_id].finished):
                continue  # offline: a request's output is made once, when it finishes
            output = self.outputs.output(request_id)
            results.append(output)
            # NOTE: a watched prefill-only request stays known until its last blocks are pinned
            # (after this step); any other finished request goes now.
            if output.finished and not self.kv_connector.is_watching(request_id):
                self._forget(request_id)
        return results

    def kv_usage(self) -> KVUsage:
        return self.block_manager.usage()

    def stats(self) -> EngineStats:
        """The one snapshot of this engine's state that metrics, heartbeats and GetStats read."""
        usage = self.block_manager.usage()
        bm = self.block_manager
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_reserved=len(self._reserved),
            num_requests=self.num_requests(),
            num_total_blocks=usage.num_total_blocks,
            num_free_blocks=usage.num_free_blocks + usage.num_cached_blocks,
            num_cached_blocks=usage.num_cached_blocks,
            num_pinned_blocks=self.block_manager.num_pinned_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefill_tokens=self.scheduler.num_prefill_tokens,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            block_size=self.config.block_size,
            lora_adapters=tuple(self.list_loras()),
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self.host_tier.stats() if self.host_tier is not None else {}),
        )

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
