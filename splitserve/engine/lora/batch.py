"""One step's LoRA metadata, and the hook the model's projections call with it.

`LoRABatch.build` turns the scheduled sequences (their token counts and adapter slots) into the
kernels' segments (`group_rows`): the rows grouped by adapter, one (first position, count, slot)
per adapter over that ordering, so the kernels read each adapter's weights once per tile of
rows rather than once per row. Base-only rows are in no segment, so they cost nothing; a step
with no adapter at all has no `LoRABatch` and the projections skip LoRA entirely. The decode
CUDA graphs cut the groups into segments of at most `TILE_ROWS` rows (their grid is fixed).

`LoRALayer` sits on a decoder layer's attention and MLP. `apply(name, x, y)` adds the batch's
LoRA products to projection output y in place (shrink, then expand): the Triton kernels with
Triton ops, their torch reference (peft's arithmetic) otherwise, as the platform decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.kernels.lora_ref import lora_expand_ref, lora_shrink_ref


def group_rows(row_slots: np.ndarray, tile: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a batch grouped by adapter: (segments [3, S] int32 of (first position,
    count, slot), rows [n] int32: the rows with a slot, each adapter's in ascending order).
    `row_slots` [T]: each row's slot, -1 for the base model. With `tile`, a group of more
    rows is cut into segments of at most `tile`."""
    rows = np.flatnonzero(row_slots >= 0)
    rows = rows[np.argsort(row_slots[rows], kind="stable")]
    by_slot = row_slots[rows]
    starts = np.flatnonzero(np.diff(by_slot, prepend=-1))  # where each adapter's rows begin
    counts = np.diff(starts, append=len(rows))
    slots = by_slot[starts]
    if tile is not None and len(rows):
        pieces = -(-counts // tile)
        group = np.repeat(np.arange(len(starts)), pieces)
        k = np.arange(len(group)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        starts, counts = starts[group] + k * tile, np.minimum(tile, counts[group] - k * tile)
        slots = slots[group]
    segments = np.stack([starts, counts, slots]).astype(np.int32)
    return segments, rows.astype(np.int32)


def tile_capacity(num_rows: int, max_adapters: int, tile: int) -> int:
    """The most segments `group_rows(..., tile)` makes of `num_rows` rows on at most
    `max_adapters` adapters: sum(ceil(n_i / tile)) < num_rows / tile + max_adapters, and
    never more than the rows."""
    return min(num_rows, -(-num_rows // tile) + max_adapters)


@dataclass(frozen=True)
class LoRABatch:
    """segments [3, num_segments] int32 over positions of `rows` (int32 row of each position;
    None: position = row), on the device; max_seg_len (the longest segment) picks the kernel
    shape."""

    segments: torch.Tensor
    max_seg_len: int
    rows: torch.Tensor | None = None

    @classmethod
    def build(
        cls, query_lens: Sequence[int], slots: Sequence[int | None], device: torch.device
    ) -> LoRABatch | None:
        """Segments for sequences of `query_lens` tokens (flattened in that order) whose
        adapters sit in `slots` (None: base model); None when no sequence has an adapter."""
        if all(slot is None for slot in slots):
            return None
        seq_slots = np.array([-1 if s is None else s for s in slots], dtype=np.int64)
        row_slots = np.repeat(seq_slots, np.asarray(query_lens, dtype=np.int64))
        segments, rows = group_rows(row_slots)
        if not rows.size:
            return None
        packed = torch.from_numpy(np.concatenate([segments.reshape(-1), rows]))
        if device.type == "cuda":  # one copy for both
            packed = packed.pin_memory().to(device, non_blocking=True)
        num_segs = segments.shape[1]
        return cls(
            packed[: 3 * num_segs].view(3, num_segs),
            int(segments[1].max()),
            packed[3 * num_segs :],
        )


class LoRAContext:
    """What every `LoRALayer` of a model reads: the current step's batch (None: no adapter
    in it) and the per-slot scales."""

    def __init__(self, scales: torch.Tensor) -> None:
        self.scales = scales
        self._batch: LoRABatch | None = None
        self._pending: tuple[Sequence[int], Sequence[int | None]] | None = None

    def describe(self, query_lens: Sequence[int], slots: Sequence[int | None]) -> None:
        """This step's sequences; their `LoRABatch` is built when a layer first asks for it
        (a decode step that replays a CUDA graph never does: the graph has its own inputs)."""
        self._pending, self._batch = (query_lens, slots), None

    @property
    def batch(self) -> LoRABatch | None:
        if self._pending is not None:
            query_lens, slots = self._pending
            self._pending = None
            self._batch = LoRABatch.build(query_lens, slots, self.scales.device)
        return self._batch

    @batch.setter
    def batch(self, value: LoRABatch | None) -> None:
        self._pending, self._batch = None, value


class LoRALayer:
    """The LoRA views of one decoder layer's projections (`engine/lora/weights.py`)."""

    def __init__(
        self,
        context: LoRAContext,
        views: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]],
        triton: bool,
        pdl: bool = False,
    ) -> None:
        self.context = context
        self.views = views
        self.triton = triton
        self.pdl = pdl  # launch the Triton kernels with PDL (kernels/pdl.py)

    @property
    def active(self) -> bool:
        """Whether this step has rows with an adapter."""
        return self.context.batch is not None

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the output of projection `name` for input x) plus each row's adapter product."""
        batch = self.context.batch
        if batch is None:
            return y
        a, b, slices = self.views[name]
        if self.triton:
            from splitserve.kernels.lora import lora_expand as expand
            from splitserve.kernels.lora import lora_shrink as shrink
        else:
            shrink, expand = lora_shrink_ref, lora_expand_ref
        s = shrink(x, a, batch.segments, batch.max_seg_len, batch.rows, pdl=self.pdl)
        expand(
            y, s, b, self.context.scales, batch.segments, batch.max_seg_len, slices, batch.rows,
            pdl=self.pdl,
        )  # fmt: skip
        return y
