"""A running request's KV kept after its stream moved away, until it is handed to the decode
worker that goes on with it (`LLMEngine` inherits this).

A decode worker that changes role (`splitserve/roles/switch.py`) ends its streams; each one's
sequence is *parked*: it leaves the batch (no step computes or samples it again, no output is
made for it) but keeps its blocks. The gateway reserves the stream on another decode worker,
which asks this one to push the KV of the tokens it needs (`take_parked` pins those blocks for
the push and frees the rest; `unpin_blocks` once the push is done). `abort_request` frees a
parked request too, so one whose hand-off never comes is freed when its lease runs out.

    running ──park──▶ parked (blocks kept, no steps) ──take_parked──▶ pinned for the push ──▶ free
                         └──────────── abort_request ───────────────────────────────────────▶ free
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.errors import FailedPrecondition, NotFound
from splitserve.engine.sequence import FinishReason, SequenceStatus

if TYPE_CHECKING:
    from splitserve.engine.block_manager import BlockManager
    from splitserve.engine.output_processor import OutputProcessor
    from splitserve.engine.overlap import InFlight
    from splitserve.engine.scheduler import Scheduler
    from splitserve.engine.sequence import Sequence


@dataclass(frozen=True)
class ParkedKV:
    """A parked request's blocks, in order, and how many of its leading tokens (prompt, then
    output) they hold the KV of."""

    block_ids: tuple[int, ...]
    num_tokens: int
    window_slots: tuple[int, ...] = ()  # their sliding layers' slots, when pinned (0: none)


class ParkingMixin:
    """Parked requests: out of the batch, their blocks kept for a hand-off."""

    block_manager: BlockManager
    scheduler: Scheduler
    outputs: OutputProcessor
    _inflight: InFlight | None
    _parked: dict[str, Sequence]

    def park(self, request_id: str) -> ParkedKV | None:
        """Stop stepping a running request and keep its KV (see the module doc). None, and
        nothing changes, when it holds none worth keeping: unknown, finished, more than one
        sample, or preempted (no blocks)."""
        state = self.outputs.requests.get(request_id)
        if state is None or len(state.sequences) != 1:
            return None
        seq = state.sequences[0]
        bm = self.block_manager
        if seq.is_finished or seq.pending_children or not bm.has_seq(seq.seq_id):
            return None
        if seq.num_computed_tokens == 0:
            return None
        if self._inflight is not None:
            # NOTE: a step in flight writes this sequence's newest KV: it lands before any
            # reader (a transfer outside the GPU stream's order) may look.
            self._inflight.wait()
        for queue in (self.scheduler.running, self.scheduler.waiting):
            if seq in queue:
                queue.remove(seq)
        # NOTE: finished, so that a step in flight skips it when it settles; not through
        # `Scheduler.finish`, which would free its blocks.
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        self.outputs.pop(request_id)
        self._parked[request_id] = seq
        return ParkedKV(tuple(bm.block_table(seq.seq_id)), seq.num_computed_tokens)

    def take_parked(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """End a parked request: its blocks holding the first `num_tokens` tokens' KV, pinned
        for a transfer (`unpin_blocks` once it is done), the rest freed. NotFound if it is not
        parked (aborted, or its lease ran out); FailedPrecondition if its KV covers fewer
        tokens (it is freed either way)."""
        return self.take_parked_kv(request_id, num_tokens).block_ids

    def take_parked_kv(
        self, request_id: str, num_tokens: int, window_from: int | None = None
    ) -> ParkedKV:
        """`take_parked`, with the sliding layers' slots of the blocks from `window_from` on
        pinned too (a window pool's; `window_slots[i]` 0 where block i holds none or is
        before `window_from`): `unpin_blocks(block_ids, window_slots)` gives them back."""
        seq = self._parked.pop(request_id, None)
        if seq is None:
            raise NotFound(f"no parked KV for request {request_id!r}")
        bm = self.block_manager
        try:
            if num_tokens > seq.num_computed_tokens:
                raise FailedPrecondition(
                    f"request {request_id!r} holds KV for {seq.num_computed_tokens} tokens, "
                    f"not {num_tokens}"
                )
            block_ids = tuple(bm.block_table(seq.seq_id)[: -(-num_tokens // bm.block_size)])
            start = len(block_ids) if window_from is None else window_from
            slots = tuple(bm.pin(b, window=i >= start) for i, b in enumerate(block_ids))
        finally:
            bm.free(seq.seq_id)
        return ParkedKV(block_ids, num_tokens, slots if any(slots) else ())

    def unpin_blocks(
        self, block_ids: tuple[int, ...] | list[int], window_slots: tuple[int, ...] = ()
    ) -> None:
        """A hand-off's transfer is over: give its blocks (and pinned window slots) back."""
        for i, block_id in enumerate(block_ids):
            window = i < len(window_slots) and window_slots[i] != 0
            self.block_manager.unpin(block_id, window=window)

    def _drop_parked(self, request_id: str) -> bool:
        """Free a parked request's blocks; False if it is not parked."""
        seq = self._parked.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq.seq_id)
        return True
