"""Where adapters live on the device: one slot-major buffer, `max_loras` slots of one layout.

A slot holds one adapter's A and B for every layer, each projection padded to `max_lora_rank`
(zero rows of A, zero columns of B: a smaller rank adds exact zeros). Per layer, in order:

    A  q | k | v   [3R, hidden]       B  q | k | v     [q_size + 2 kv_size, R]
    A  o           [R, q_size]        B  o             [hidden, R]
    A  gate | up   [2R, hidden]       B  gate | up     [2 intermediate, R]
    A  down        [R, intermediate]  B  down          [hidden, R]

so a merged projection (q/k/v, gate/up) reads its slices' A as one [slots, 3R, K] view and
its B as one [slots, N, R] view, and a whole adapter swaps in with one copy of one flat host
tensor packed in the same layout (`pack`). Every view is `[slots, rows, cols]` with the slot
stride of the buffer: the kernels gather a row's slot by that stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.lora.adapter import LoRAAdapter, projection_shape
from splitserve.engine.model_config import ModelConfig

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""A layer's projection groups: the slices of one merged GEMM share a group."""


@dataclass(frozen=True)
class Region:
    """A projection group's A and B within a slot: offsets (elements) and shapes."""

    a_offset: int
    a_shape: tuple[int, int]  # [slices * R, in_features]
    b_offset: int
    b_shape: tuple[int, int]  # [sum of out_features, R]
    slices: tuple[int, ...]  # each slice's out_features


class SlotLayout:
    """The offsets of every (layer, group) in a slot of rank `max_rank`."""

    def __init__(self, cfg: ModelConfig, max_rank: int) -> None:
        self.max_rank = max_rank
        self.regions: dict[tuple[int, str], Region] = {}
        offset = 0
        for layer in range(cfg.num_layers):
            for group, modules in GROUPS.items():
                in_f = projection_shape(cfg, modules[0])[0]
                slices = tuple(projection_shape(cfg, m)[1] for m in modules)
                a_shape = (len(modules) * max_rank, in_f)
                b_shape = (sum(slices), max_rank)
                a_offset, offset = offset, offset + a_shape[0] * a_shape[1]
                b_offset, offset = offset, offset + b_shape[0] * b_shape[1]
                self.regions[(layer, group)] = Region(a_offset, a_shape, b_offset, b_shape, slices)
        self.numel = offset

    def views(
        self, flat: torch.Tensor, layer: int, group: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [slots, RA, K], B [slots, N, R]) of a group in `flat` [slots, numel]."""
        region = self.regions[(layer, group)]
        stride = flat.stride(0)
        a = flat.as_strided(
            (flat.shape[0], *region.a_shape), (stride, region.a_shape[1], 1), region.a_offset
        )
        b = flat.as_strided(
            (flat.shape[0], *region.b_shape), (stride, region.b_shape[1], 1), region.b_offset
        )
        return a, b

    def pack(self, adapter: LoRAAdapter, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """The adapter as one flat host tensor [numel] in this layout, zero-padded."""
        flat = torch.zeros(1, self.numel, dtype=dtype, pin_memory=pin)
        r, big_r = adapter.rank, self.max_rank
        for (layer, module), (a, b) in adapter.weights.items():
            group = next(g for g, modules in GROUPS.items() if module in modules)
            j = GROUPS[group].index(module)
            a_view, b_view = self.views(flat, layer, group)
            lo = sum(self.regions[(layer, group)].slices[:j])
            a_view[0, j * big_r : j * big_r + r] = a
            b_view[0, lo : lo + b.shape[0], :r] = b
        return flat[0]


def module_views(
    layout: SlotLayout, flat: torch.Tensor, layer: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]]:
    """Every view a layer's projections use, by name: the merged groups ("qkv", "o",
    "gate_up", "down") and each single projection ("q_proj", ...), as (A, B, slices)."""
    views: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}
    r = layout.max_rank
    for group, modules in GROUPS.items():
        a, b = layout.views(flat, layer, group)
        slices = layout.regions[(layer, group)].slices
        views[group] = (a, b, slices)
        lo = 0
        for j, (module, width) in enumerate(zip(modules, slices, strict=True)):
            views[module] = (a[:, j * r : (j + 1) * r], b[:, lo : lo + width], (width,))
            lo += width
    return views
