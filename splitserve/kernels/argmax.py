"""Row-wise argmax of logits [rows, vocab] for greedy decoding, in two short passes.

torch's argmax gives a row to one thread block: a single 128k-vocabulary row takes ~37 µs on an
H200, as long as a few layers of the batch-1 step. Here pass one splits each row into BLOCK-wide
chunks (max and first index of the max in each), pass two picks the first chunk holding the row's
maximum. Ties resolve to the lowest index, as torch.argmax resolves them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = ["argmax_rows", "argmax_rows_ref"]

CHUNK = 4096


@triton.jit
def _chunk_max_kernel(
    x_ptr,
    part_val_ptr,
    part_idx_ptr,
    vocab,
    num_chunks,
    stride_x,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    value, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_val_ptr + row * num_chunks + chunk, value)
    tl.store(part_idx_ptr + row * num_chunks + chunk, chunk * BLOCK + index)


@triton.jit
def _pick_chunk_kernel(
    part_val_ptr,
    part_idx_ptr,
    out_ptr,
    num_chunks,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    mask = chunks < num_chunks
    values = tl.load(part_val_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    _, best = tl.max(values, 0, return_indices=True, return_indices_tie_break_left=True)
    index = tl.load(part_idx_ptr + row * num_chunks + best)
    tl.store(out_ptr + row, index.to(tl.int64))


def argmax_rows(
    x: torch.Tensor, out: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """x [rows, vocab] float -> out [rows] int64, the first index of each row's maximum."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("x must have at least one column")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    check_tensor("out", out, dtypes=(torch.int64,), shape=(rows,))
    check_devices(_chunk_max_kernel, x=x, out=out)
    if rows == 0:
        return out
    block = min(CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, block)
    part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    pdl = use_pdl(_chunk_max_kernel, x.device, pdl)
    _chunk_max_kernel[(rows, num_chunks)](
        x,
        part_val,
        part_idx,
        vocab,
        num_chunks,
        x.stride(0),
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=8 if block >= 2048 else 4,
        **launch_options(pdl),
    )
    _pick_chunk_kernel[(rows,)](
        part_val,
        part_idx,
        out,
        num_chunks,
        BLOCK_C=max(16, triton.next_power_of_2(num_chunks)),
        USE_PDL=pdl,
        num_warps=1,
        **launch_options(pdl),
    )
    return out


def argmax_rows_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch `argmax_rows`."""
    result = x.argmax(dim=-1)
    if out is None:
        return result
    return out.copy_(result)
