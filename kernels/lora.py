"""Batched LoRA for a batch that mixes adapters: shrink (x @ A^T), then expand (@ B^T * scale).

Every row of a batch belongs to at most one adapter, held in a GPU slot. The batch is described
by segments, one int32 tensor [3, num_segments] of (first row, row count, slot): rows of one
segment share an adapter; rows in no segment (base-only rows) are never read or written, so
they cost nothing. A slot of -1 is a segment to skip (a padded row of a CUDA graph bucket).

    shrink  s[p, t, :]  = x[t, k-range p] @ A[slot(t)]^T         float32 partial sums [P, T, RA]
    expand  y[t, :]    += (sum_p s[p, t]) @ B[slot(t)]^T * scale[slot(t)]

A is [slots, RA, K] (RA = R times the number of output slices); B is [slots, N, R]. A merged
projection (q/k/v, gate/up) shrinks once with its slices' A rows stacked, and its expand's
output columns in slice j (`slices` gives the boundaries) read s's columns j*R .. (j+1)*R.
Both A and B may be strided views of one slot-major buffer (engine/lora/weights.py).

Two shapes of kernel, picked by the longest segment:
- decode (every segment one row): BGMV, one program per (row, K split) for the shrink and per
  (row, BLOCK_N output columns) for the expand, each gathering its row's A / B by slot. The
  shrink's K splits write separate partial sums that the expand adds as it reads them, so no
  atomics and no reduce launch; the expand's tile never crosses a slice boundary.
- prefill: SGMV, tensor-core tiles of BLOCK_M rows of one segment (`tl.dot`).

`kernels/lora_ref.py` holds the plain-torch reference with the same signatures, in peft's
arithmetic (`y + lora_B(lora_A(x)) * scaling`); the engine runs it on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor, dot_precision
from splitserve.kernels.lora_ref import check_slices as _slice_bounds

__all__ = ["lora_expand", "lora_shrink"]


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


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, s_ptr, seg_ptr,
    num_segs, T, K, RA, k_per_split,
    stride_xm, stride_as, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(1)
    slot = tl.load(seg_ptr + 2 * num_segs + seg)
    m0 = tl.program_id(0) * BLOCK_M
    seg_len = tl.load(seg_ptr + num_segs + seg)
    if slot < 0 or m0 >= seg_len:
        return
    split = tl.program_id(2)
    ms = m0 + tl.arange(0, BLOCK_M)
    m_mask = ms < seg_len
    rows = (tl.load(seg_ptr + seg) + ms).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < RA
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + rs[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_hi
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(a_cols + ks[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(x, a.to(x.dtype), acc, input_precision=PRECISION)
    tl.store(
        s_ptr + (split * T + rows[:, None]) * RA + rs[None, :],
        acc,
        mask=m_mask[:, None] & r_mask[None, :],
    )


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, s_ptr, b_ptr, scale_ptr, seg_ptr,
    num_segs, T, N, R, RA, P, n_split1, n_split2,
    stride_ym, stride_bs, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(1)
    slot = tl.load(seg_ptr + 2 * num_segs + seg)
    m0 = tl.program_id(0) * BLOCK_M
    seg_len = tl.load(seg_ptr + num_segs + seg)
    if slot < 0 or m0 >= seg_len:
        return
    n0 = tl.program_id(2) * BLOCK_N
    j = (n0 >= n_split1).to(tl.int32) + (n0 >= n_split2).to(tl.int32)
    ms = m0 + tl.arange(0, BLOCK_M)
    m_mask = ms < seg_len
    rows = (tl.load(seg_ptr + seg) + ms).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < R
    sm = m_mask[:, None] & r_mask[None, :]
    s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for p in range(P):
        s += tl.load(s_ptr + (p * T + rows[:, None]) * RA + j * R + rs[None, :], mask=sm, other=0.0)
    ns = n0 + tl.arange(0, BLOCK_N)
    n_mask = ns < N
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + ns[None, :] * stride_bn + rs[:, None],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    # NOTE: s is rounded to the weights' dtype first, as peft's lora_A output is.
    out = tl.dot(s.to(b.dtype), b, input_precision=PRECISION) * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + ns[None, :]
    ym = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=ym, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + out).to(y.dtype), mask=ym)


def _check_segments(segments: torch.Tensor) -> int:
    check_tensor("segments", segments, ndim=2, dtypes=(torch.int32,), contiguous=True)
    if segments.shape[0] != 3:
        raise ValueError(f"segments must be [3, num_segments], got {tuple(segments.shape)}")
    return segments.shape[1]


def _check_slots(name: str, w: torch.Tensor, dtype: torch.dtype) -> None:
    check_tensor(name, w, ndim=3, dtypes=(dtype,))


def _pow2(n: int, low: int) -> int:
    return max(low, triton.next_power_of_2(n))


def _split_k(num_programs: int, k: int, block_k: int) -> int:
    """K splits for the shrink: enough programs to fill the GPU (~256), each a few tiles long."""
    want = max(1, 256 // max(1, num_programs))
    return max(1, min(want, k // (4 * block_k)))


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, segments: torch.Tensor, max_seg_len: int
) -> torch.Tensor:
    """x [T, K] @ A[slot]^T for the rows of every segment: float32 partial sums [P, T, RA]
    (P K splits; add them up for the product). Rows in no segment are left undefined."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_slots("a", a, x.dtype)
    num_segs = _check_segments(segments)
    check_devices(_bgmv_shrink_kernel, x=x, a=a, segments=segments)
    T, K = x.shape
    RA = a.shape[1]
    if a.shape[2] != K:
        raise ValueError(f"a {tuple(a.shape)} does not fit x {tuple(x.shape)}")
    if max_seg_len <= 1:
        block_r = _pow2(RA, 1)
        block_k = max(16, min(512, 8192 // block_r))
        split = _split_k(num_segs, K, block_k)
        per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
        s = torch.empty((split, T, RA), dtype=torch.float32, device=x.device)
        if num_segs:
            _bgmv_shrink_kernel[(num_segs, split)](
                x, a, s, segments, num_segs, T, K, RA, per,
                x.stride(0), a.stride(0), a.stride(1),
                BLOCK_R=block_r, BLOCK_K=block_k,
            )  # fmt: skip
        return s
    block_m, block_r = 32, _pow2(RA, 16)
    block_k = 64 if block_r <= 64 else 32
    m_tiles = triton.cdiv(max_seg_len, block_m)
    split = _split_k(num_segs * m_tiles, K, block_k)
    per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    s = torch.empty((split, T, RA), dtype=torch.float32, device=x.device)
    if num_segs:
        _sgmv_shrink_kernel[(m_tiles, num_segs, split)](
            x, a, s, segments, num_segs, T, K, RA, per,
            x.stride(0), a.stride(0), a.stride(1),
            BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
            PRECISION=dot_precision(x.dtype),
        )  # fmt: skip
    return s


def _block_n(slices: tuple[int, ...], cap: int) -> int:
    """The widest power-of-two tile (<= cap) that divides every slice but the last, so no
    tile crosses a slice boundary."""
    block = cap
    for width in slices[:-1]:
        while width % block:
            block //= 2
    return block


def lora_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    segments: torch.Tensor,
    max_seg_len: int,
    slices: tuple[int, ...] | None = None,
) -> None:
    """y[t] += (sum_p s[p, t]) @ B[slot]^T * scales[slot] for the rows of every segment, in
    place. y [T, N] (rows may be strided), s [P, T, RA] float32, b [slots, N, R], scales
    [slots] float32; output columns of slice j (`slices`: widths, default one slice of N)
    read s's columns j*R .. (j+1)*R."""
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("s", s, ndim=3, dtypes=(torch.float32,), contiguous=True)
    _check_slots("b", b, y.dtype)
    check_tensor("scales", scales, ndim=1, dtypes=(torch.float32,))
    num_segs = _check_segments(segments)
    check_devices(_bgmv_expand_kernel, y=y, s=s, b=b, scales=scales, segments=segments)
    T, N = y.shape
    R, RA = b.shape[2], s.shape[2]
    slices = slices or (N,)
    n1, n2 = _slice_bounds(slices, N)
    if b.shape[1] != N or s.shape[1] != T or R * len(slices) != RA:
        raise ValueError(
            f"y {tuple(y.shape)}, s {tuple(s.shape)} and b {tuple(b.shape)} do not fit "
            f"{len(slices)} slice(s)"
        )
    if not num_segs:
        return
    P = s.shape[0]
    if max_seg_len <= 1:
        block_r = _pow2(R, 1)
        block_n = _block_n(slices, max(16, min(256, 4096 // block_r)))
        _bgmv_expand_kernel[(num_segs, triton.cdiv(N, block_n))](
            y, s, b, scales, segments, num_segs, T, N, R, RA, P, n1, n2,
            y.stride(0), b.stride(0), b.stride(1),
            BLOCK_R=block_r, BLOCK_N=block_n,
        )  # fmt: skip
        return
    block_m, block_r = 32, _pow2(R, 16)
    block_n = _block_n(slices, 64)
    if block_n < 16:  # tl.dot's smallest tile: one launch per slice instead
        for j, (lo, width) in enumerate(zip((0, *(n1, n2)), slices, strict=False)):
            part = s[:, :, j * R : (j + 1) * R].contiguous()
            lora_expand(y[:, lo : lo + width], part, b[:, lo : lo + width], scales, segments,
                        max_seg_len)  # fmt: skip
        return
    grid = (triton.cdiv(max_seg_len, block_m), num_segs, triton.cdiv(N, block_n))
    _sgmv_expand_kernel[grid](
        y, s, b, scales, segments, num_segs, T, N, R, RA, P, n1, n2,
        y.stride(0), b.stride(0), b.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n,
        PRECISION=dot_precision(y.dtype),
    )  # fmt: skip
