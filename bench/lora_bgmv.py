"""The per-row decode LoRA kernels (BGMV) that `kernels/lora.py` replaced, kept as a baseline
for bench/lora_kernels.py: one program per (row, K split) for the shrink and per (row, BLOCK_N
columns) for the expand, each gathering its row's adapter by slot, so every row reads its
adapter's whole A and B. One segment per row (first row, 1, slot); slot -1 skips the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, s_ptr, seg_ptr,
    num_segs, T, K, RA, k_per_split,
    stride_xm, stride_as, stride_ar,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(seg_ptr + 2 * num_segs + seg)
    if slot < 0:
        return
    row = tl.load(seg_ptr + seg).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < RA
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + rs[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_hi
        x = tl.load(x_ptr + row * stride_xm + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + ks[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(s_ptr + (split * T + row) * RA + rs, acc, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr, s_ptr, b_ptr, scale_ptr, seg_ptr,
    num_segs, T, N, R, RA, P, n_split1, n_split2,
    stride_ym, stride_bs, stride_bn,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    slot = tl.load(seg_ptr + 2 * num_segs + seg)
    if slot < 0:
        return
    row = tl.load(seg_ptr + seg).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    # The slice this tile lies in (tiles never cross a slice boundary) picks s's columns.
    j = (n0 >= n_split1).to(tl.int32) + (n0 >= n_split2).to(tl.int32)
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < R
    s = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for p in range(P):
        s += tl.load(s_ptr + (p * T + row) * RA + j * R + rs, mask=r_mask, other=0.0)
    ns = n0 + tl.arange(0, BLOCK_N)
    n_mask = ns < N
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + ns[:, None] * stride_bn + rs[None, :],
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    out = tl.sum(b.to(tl.float32) * s[None, :], axis=1) * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + row * stride_ym + ns
    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + out).to(y.dtype), mask=n_mask)


def _block_n(slices: tuple[int, ...], cap: int) -> int:
    block = cap
    for width in slices[:-1]:
        while width % block:
            block //= 2
    return block


def bgmv_shrink(x: torch.Tensor, a: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Partial sums [P, T, RA] of x @ A[slot]^T, a program per (row, K split)."""
    T, K = x.shape
    RA, num_segs = a.shape[1], segments.shape[1]
    block_r = max(1, triton.next_power_of_2(RA))
    block_k = max(16, min(512, 8192 // block_r))
    split = max(1, min(max(1, 256 // max(1, num_segs)), K // (4 * block_k)))
    per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    s = torch.empty((split, T, RA), dtype=torch.float32, device=x.device)
    _bgmv_shrink_kernel[(num_segs, split)](
        x, a, s, segments, num_segs, T, K, RA, per,
        x.stride(0), a.stride(0), a.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    return s


def bgmv_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    segments: torch.Tensor,
    slices: tuple[int, ...],
) -> None:
    """y[row] += s[row] @ B[slot]^T * scale, a program per (row, output tile)."""
    T, N = y.shape
    R, RA, num_segs = b.shape[2], s.shape[2], segments.shape[1]
    bounds = [sum(slices[: i + 1]) for i in range(len(slices) - 1)] + [N, N]
    block_r = max(1, triton.next_power_of_2(R))
    block_n = _block_n(slices, max(16, min(256, 4096 // block_r)))
    _bgmv_expand_kernel[(num_segs, triton.cdiv(N, block_n))](
        y, s, b, scales, segments, num_segs, T, N, R, RA, s.shape[0], bounds[0], bounds[1],
        y.stride(0), b.stride(0), b.stride(1),
        BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
