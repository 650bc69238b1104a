"""The plain-torch reference of `kernels/lora.py`'s batched LoRA, with the same signatures.

peft's arithmetic, operation for operation: `y + lora_B(lora_A(x)) * scaling`, each product in
the model's dtype. The engine runs it on the CPU (and the torch backend); the kernel tests
compare the Triton kernels with it. Imports no Triton.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16
"""The most rows a decode tile of the Triton kernels holds (`kernels/lora.py`): the CUDA graphs
cut each adapter's rows into segments of at most this many (engine/lora/batch.py)."""


def check_slices(slices: tuple[int, ...], n: int) -> tuple[int, int]:
    """The two inner boundaries of 1 to 3 output slices adding up to n (n where absent)."""
    if not 1 <= len(slices) <= 3 or sum(slices) != n or min(slices) <= 0:
        raise ValueError(f"slices {slices} must be 1 to 3 positive widths adding up to {n}")
    bounds = [sum(slices[: i + 1]) for i in range(len(slices) - 1)]
    bounds += [n] * (2 - len(bounds))
    return bounds[0], bounds[1]


def _segment_list(
    segments: torch.Tensor, rows: torch.Tensor | None
) -> list[tuple[torch.Tensor | slice, int]]:
    """(the segment's rows, slot) of every segment to run."""
    starts, lens, slots = segments.tolist()
    out: list[tuple[torch.Tensor | slice, int]] = []
    for start, n, slot in zip(starts, lens, slots, strict=True):
        if slot < 0 or n <= 0:
            continue
        if rows is None:
            out.append((slice(start, start + n), slot))
        else:
            out.append((rows[start : start + n].long(), slot))
    return out


def lora_shrink_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    segments: torch.Tensor,
    max_seg_len: int,
    rows: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """`lora_shrink` in plain torch: one part (P = 1); rows in no segment are zero."""
    s = torch.zeros((1, x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for index, slot in _segment_list(segments, rows):
        s[0, index] = (x[index] @ a[slot].t()).float()
    return s


def lora_expand_ref(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    segments: torch.Tensor,
    max_seg_len: int,
    slices: tuple[int, ...] | None = None,
    rows: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> None:
    """`lora_expand` in plain torch, in peft's order: y + (s @ B^T) * scale, each rounded to
    y's dtype as peft's modules round."""
    N, R = y.shape[1], b.shape[2]
    slices = slices or (N,)
    check_slices(slices, N)
    scale_list = scales.tolist()
    for index, slot in _segment_list(segments, rows):
        part = s[:, index].sum(0).to(y.dtype)
        lo = 0
        for j, width in enumerate(slices):
            cols = slice(lo, lo + width)
            delta = (part[:, j * R : (j + 1) * R] @ b[slot, cols].t()) * scale_list[slot]
            y[index, cols] = y[index, cols] + delta
            lo += width
