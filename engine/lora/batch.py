"""One step's LoRA metadata, and the hook the model's projections call with it.

`LoRABatch.build` turns the scheduled sequences (their token counts and adapter slots) into the
kernels' segments: one (first row, row count, slot) per sequence that has an adapter. Base-only
sequences get no segment, so their rows cost nothing; a step with no adapter at all has no
`LoRABatch` and the projections skip LoRA entirely.

`LoRALayer` sits on a decoder layer's attention and MLP. `apply(name, x, y)` adds the batch's
LoRA products to projection output y in place (shrink, then expand): the Triton kernels with
Triton ops, their torch reference (peft's arithmetic) otherwise, as the platform decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.kernels.lora_ref import lora_expand_ref, lora_shrink_ref


@dataclass(frozen=True)
class LoRABatch:
    """segments [3, num_segments] int32 on the device; max_seg_len picks the kernel shape."""

    segments: torch.Tensor
    max_seg_len: int

    @classmethod
    def build(
        cls, query_lens: Sequence[int], slots: Sequence[int | None], device: torch.device
    ) -> LoRABatch | None:
        """Segments for sequences of `query_lens` tokens (flattened in that order) whose
        adapters sit in `slots` (None: base model); None when no sequence has an adapter."""
        starts, lens, used = [], [], []
        row = 0
        for n, slot in zip(query_lens, slots, strict=True):
            if slot is not None and n > 0:
                starts.append(row)
                lens.append(n)
                used.append(slot)
            row += n
        if not used:
            return None
        segments = torch.tensor([starts, lens, used], dtype=torch.int32)
        if device.type == "cuda":
            segments = segments.pin_memory().to(device, non_blocking=True)
        return cls(segments, max(lens))


class LoRAContext:
    """What every `LoRALayer` of a model reads: the current step's batch (None: no adapter
    in it) and the per-slot scales."""

    def __init__(self, scales: torch.Tensor) -> None:
        self.scales = scales
        self.batch: LoRABatch | None = None


class LoRALayer:
    """The LoRA views of one decoder layer's projections (`engine/lora/weights.py`)."""

    def __init__(
        self,
        context: LoRAContext,
        views: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]],
        triton: bool,
    ) -> None:
        self.context = context
        self.views = views
        self.triton = triton

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
        s = shrink(x, a, batch.segments, batch.max_seg_len)
        expand(y, s, b, self.context.scales, batch.segments, batch.max_seg_len, slices)
        return y
