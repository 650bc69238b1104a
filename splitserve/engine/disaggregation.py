"""The engine's side of disaggregated serving (`LLMEngine` inherits it): a decode worker
reserves blocks for a prompt whose KV is pushed to it and admits the request once it landed; a
prefill worker's KV connector reads how far each prompt is computed; a decode worker's prefix
index reads the prefix cache's insertions and evictions.

Kept apart from `engine/llm_engine.py` so the engine's step loop stays readable; it reads and
writes the engine's reservations (`_reserved`), request states and block tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.errors import InvalidRequest, NotFound, Overloaded
from splitserve.engine.host_index import GPU_TIER, HOST_TIER
from splitserve.engine.output_processor import RequestState
from splitserve.engine.outputs import RequestOutput, Resume, SampledToken
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from splitserve.engine.block_manager import BlockManager
    from splitserve.engine.grammar import Grammars
    from splitserve.engine.lora.request import LoRARequest
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.output_processor import OutputProcessor
    from splitserve.engine.overlap import InFlight
    from splitserve.engine.scheduler import Scheduler
    from splitserve.engine.sequence import Sequence


class CapacityError(Overloaded):
    """The KV pool can't take this request now (a retryable condition, not a bad request)."""


@dataclass(frozen=True)
class Reservation:
    """Blocks held on a decode worker for a prompt, and how many leading tokens it caches.

    With sliding layers kept apart (engine/window_slots.py), `window_slots[i]` is the window
    pool's slot of `block_ids[i]` (0: none): only the blocks that the first query after the
    reserved tokens sees have one, and a sender writes the sliding layers' KV of those only."""

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    window_slots: tuple[int, ...] = ()


class DisaggregationMixin:
    """Reservations and admission (decode workers), prompt progress (prefill workers)."""

    block_manager: BlockManager
    scheduler: Scheduler
    outputs: OutputProcessor
    grammars: Grammars
    model_config: ModelConfig
    _reserved: dict[str, Sequence]
    _inflight: InFlight | None

    if TYPE_CHECKING:  # NOTE: `LLMEngine`'s and `LoRAEngineMixin`'s

        def _resolve_lora(
            self, request: LoRARequest | str | None
        ) -> tuple[str | None, bytes | None]: ...

        def _new_sequence(
            self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int = 0
        ) -> Sequence: ...

        def _validate(self, token_ids: list[int], params: SamplingParams) -> None: ...

        def _process_outputs(self, touched: list[Sequence]) -> list[RequestOutput]: ...

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        resume: Resume | None = None, lora_name: str | None = None,
    ) -> Reservation:  # fmt: skip
        """Decode side of disaggregation: hold blocks for a prompt whose KV will be pushed here
        (or, with `resume`, for a broken-off sample's prompt and tokens, computed here).

        Blocks this worker already caches for the prompt's prefix are reused; only the rest
        need to be sent. Raises InvalidRequest on bad input, CapacityError when full."""
        lora = self._resolve_lora(lora_name)  # NOTE: a prefill under another adapter is refused
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        seq.lora_name, seq.prefix_root = lora
        if self._inflight is not None:
            # NOTE: blocks freed while a step was in flight may still take its KV writes;
            # remote writers fill a reservation outside the GPU stream's order.
            self._inflight.wait()
        if resume is not None:
            seq.resume(resume, self.model_config.vocab_size)
        bm = self.block_manager
        hit = bm.find_prefix_hit(seq.token_ids, seq.prefix_root)
        # NOTE: with a window pool, slots only for what the first query after the KV that
        # comes (a push: the prompt; a hand-off: all but the last token) sees
        first_query = seq.num_tokens - 1
        if bm.allocate(seq.seq_id, seq.num_tokens, hit, first_query) is None:
            raise CapacityError(
                f"no room for {seq.num_tokens} prompt tokens: "
                f"{bm.usage().num_free_blocks + bm.usage().num_cached_blocks} blocks available"
            )
        seq.num_computed_tokens = hit.num_tokens(bm.block_size) if hit else 0
        seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, len(prompt_token_ids))
        self._reserved[request_id] = seq
        table = tuple(bm.block_table(seq.seq_id))
        slots: tuple[int, ...] = ()
        if bm.window is not None:
            live = bm.window.first_live(first_query)
            slots = tuple(bm.window_slot(b) if i >= live else 0 for i, b in enumerate(table))
        return Reservation(table, seq.num_computed_tokens, slots)

    def admit(
        self,
        request_id: str,
        params: SamplingParams,
        first_tokens: list[SampledToken] | None,
        priority: int = 0,
        kv_present: bool = False,
    ) -> list[RequestOutput]:
        """Start a reserved request. With `first_tokens` its whole prompt KV has been written
        into the reserved blocks and it joins the running batch; without, it is prefilled here.
        With `kv_present` (a resumed sample whose KV was handed off, engine/parking.py) the
        blocks hold the KV of every token but the last, which is its next input: it joins the
        batch and decodes, nothing is recomputed. Returns the request's output if the first
        tokens already finish it."""
        seq = self._reserved.get(request_id)
        if seq is None:
            raise NotFound(f"no reservation for request {request_id!r}")
        if kv_present and (first_tokens or params.n != 1):
            raise InvalidRequest("handed-off KV comes with one resumed sample, no first tokens")
        self._validate(seq.prompt_token_ids, params)  # NOTE: the reservation's were others
        seq.params, seq.priority = params, priority
        seq.pending_children = [seq.make_child(i) for i in range(1, params.n)]
        # NOTE: resumed tokens the grammar refuses leave the reservation in place (an abort
        # frees it).
        self.grammars.attach([seq, *seq.pending_children], params.structured)
        del self._reserved[request_id]
        self.outputs.add(
            RequestState(request_id, None, seq.prompt_token_ids, [seq, *seq.pending_children])
        )
        if self.block_manager.window is not None and not (kv_present or first_tokens):
            # NOTE: reserved with window slots for the first query after its KV only; computed
            # here, its prefill's queries see earlier blocks: it starts afresh, finding its
            # cached prefix again, as any new request does
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = seq.num_cached_prompt_tokens = 0
        if kv_present:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.cache_blocks(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.prefix_root
            )
            seq.status = SequenceStatus.PREFILLED
        if kv_present or not first_tokens:
            self.scheduler.add(seq)
            return []
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.cache_blocks(
            seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.prefix_root
        )
        touched = self.scheduler.admit_prefilled(seq, first_tokens)
        return self._process_outputs(touched)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """Blocks of a request's first sequence (a reservation, or a running request)."""
        return tuple(self.block_manager.block_table(f"{request_id}#0"))

    def _prompt_progress(self, request_id: str) -> tuple[int, int, list[int]] | None:
        state = self.outputs.requests.get(request_id)
        if state is None:
            return None
        seq = state.sequences[0]
        if not self.block_manager.has_seq(seq.seq_id):
            return None
        prompt_len = len(seq.prompt_token_ids)
        computed = min(seq.num_computed_tokens, prompt_len)
        return computed, prompt_len, self.block_manager.block_table(seq.seq_id)

    def num_computed_prompt_tokens(self, request_id: str) -> int | None:
        """How much of a request's prompt is computed (None if unknown or without blocks)."""
        progress = self._prompt_progress(request_id)
        return None if progress is None else progress[0]

    def take_prefix_events(self) -> list[tuple[bool, bytes, str]]:
        """Prefix-cache insertions (True) and evictions (False) of block hashes since the last
        call, in order within each tier: (added, hash, GPU_TIER) of the GPU pool's, then
        (added, hash, HOST_TIER) of the host tier's (recorded only with
        `record_prefix_events`). NOTE: a block is often in both (the host tier is written
        through): the tiers are indexed apart, so their relative order does not matter."""
        events = [(a, h, GPU_TIER) for a, h in self.block_manager.pool.drain_events()]
        host = self.block_manager.host
        if host is not None:
            events += [(a, h, HOST_TIER) for a, h in host.drain_events()]
        return events
