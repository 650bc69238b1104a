"""Stage 2 of split-K decode attention (kernels/decode_attention.py): merge each (sequence,
query head)'s per-split partial outputs into one.

Split s left o_s (its output normalised by its own sum l_s) and lse_s = m_s + log2(l_s); the
merged output is sum_s 2^lse_s o_s / sum_s 2^lse_s, computed against the largest lse. An
attention sink is already inside split 0's sum (see that kernel), so it is counted exactly once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.pdl import launch_options, pdl_start


@triton.jit
def merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    base = seq * stride_pb + head * stride_ph
    lse = tl.load(part_lse_ptr + base + splits, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # All splits empty (seq_len == 0): shift by 0 so that the weights are exp2(-inf) = 0.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, 0)
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        merged.to(out_ptr.dtype.element_ty),
    )


def merge_splits(
    out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, pdl: bool = False
) -> None:
    """Launch the merge: `part_out` [rows, heads, splits, head_dim] and `part_lse` [rows, heads,
    splits] (float32, contiguous) into `out` [rows, heads, head_dim]."""
    rows, num_heads, num_splits, head_dim = part_out.shape
    merge_splits_kernel[(rows, num_heads)](
        out,
        part_out,
        part_lse,
        num_splits,
        out.stride(0),
        out.stride(1),
        num_heads * num_splits,
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        USE_PDL=pdl,
        num_warps=4 if head_dim >= 128 else 2,
        **launch_options(pdl),
    )
