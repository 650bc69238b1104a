"""Batched LoRA for a batch that mixes adapters: shrink (x @ A^T), then expand (@ B^T * scale).

Every row of a batch belongs to at most one adapter, held in a GPU slot. The batch is described
by segments, one int32 tensor [3, num_segments] of (first position, count, slot), over the rows
listed in `rows` (int32; position p is row rows[p]; without `rows`, position p is row p). Rows
of one segment share an adapter; rows in no segment (base-only rows) are never read or written,
so they cost nothing. A slot of -1 is a segment to skip (unused capacity of a CUDA graph).

    shrink  s[p, t, :]  = x[t, k-range p] @ A[slot(t)]^T         float32 partial sums [P, T, RA]
    expand  y[t, :]    += (sum_p s[p, t]) @ B[slot(t)]^T * scale[slot(t)]

A is [slots, RA, K] (RA = R times the number of output slices); B is [slots, N, R]. A merged
projection (q/k/v, gate/up) shrinks once with its slices' A rows stacked, and its expand's
output columns in slice j (`slices` gives the widths) read s's columns j*R .. (j+1)*R.
Both A and B may be strided views of one slot-major buffer (engine/lora/weights.py).

One kernel pair for decode and prefill: a program owns BLOCK_M positions of one segment (so all
its rows share the adapter) and runs tensor-core tiles (`tl.dot`). Grouping a decode batch's
rows by adapter (`rows`, engine/lora/batch.py) is what makes this pay: a slot's A and B are read
once per tile of up to BLOCK_M rows instead of once per row, and one adapter costs one tile's
weights whether 1 or 16 rows use it. Segments of at most TILE_ROWS positions (the decode graphs
cut them so) run BLOCK_M = TILE_ROWS with split-K shrinks and expand programs that each walk a
range of columns; longer segments (prefill) run BLOCK_M = 32 tiles. The shrink's K splits write
separate partial sums that the expand adds as it reads them: no atomics, no reduce launch.

`kernels/lora_ref.py` holds the plain-torch reference with the same signatures, in peft's
arithmetic (`y + lora_B(lora_A(x)) * scaling`); the engine runs it on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor, dot_precision
from splitserve.kernels.lora_ref import TILE_ROWS
from splitserve.kernels.lora_ref import check_slices as _slice_bounds
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = ["lora_expand", "lora_shrink"]


@triton.jit
def _tile_rows(seg_ptr, rows_ptr, num_segs, BLOCK_M: tl.constexpr, GATHER: tl.constexpr):
    """(slot, rows [BLOCK_M] int64, row mask) of this program's tile; slot -1: nothing to do."""
    seg = tl.program_id(1)
    slot = tl.load(seg_ptr + 2 * num_segs + seg)
    m0 = tl.program_id(0) * BLOCK_M
    seg_len = tl.load(seg_ptr + num_segs + seg)
    seg_len = tl.where(slot >= 0, seg_len, 0)  # a skipped segment reads no rows
    slot = tl.where(m0 < seg_len, slot, -1)
    ms = m0 + tl.arange(0, BLOCK_M)
    m_mask = ms < seg_len
    pos = tl.load(seg_ptr + seg) + ms
    if GATHER:
        rows = tl.load(rows_ptr + pos, mask=m_mask, other=0).to(tl.int64)
    else:
        rows = pos.to(tl.int64)
    return slot, rows, m_mask


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, seg_ptr, rows_ptr,
    num_segs, T, K, RA, k_per_split,
    stride_xm, stride_as, stride_ar,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    slot, rows, m_mask = _tile_rows(seg_ptr, rows_ptr, num_segs, BLOCK_M, GATHER)
    if slot < 0:
        return
    split = tl.program_id(2)
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
def _expand_kernel(
    y_ptr, s_ptr, b_ptr, scale_ptr, seg_ptr, rows_ptr,
    num_segs, T, N, R, RA, P, n1, n2, n_per,
    stride_ym, stride_bs, stride_bn,
    GATHER: tl.constexpr, SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    slot, rows, m_mask = _tile_rows(seg_ptr, rows_ptr, num_segs, BLOCK_M, GATHER)
    if slot < 0:
        return
    n_lo = tl.program_id(2) * n_per
    n_hi = tl.minimum(n_lo + n_per, N)
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < R
    sm = m_mask[:, None] & r_mask[None, :]
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    scale = tl.load(scale_ptr + slot)
    for j in tl.static_range(SLICES):
        # The part of this program's columns in slice j, which reads s's columns j*R ...
        if j == 0:
            lo = n_lo
            hi = tl.minimum(n_hi, n1)
        elif j == 1:
            lo = tl.maximum(n_lo, n1)
            hi = tl.minimum(n_hi, n2)
        else:
            lo = tl.maximum(n_lo, n2)
            hi = n_hi
        if lo < hi:
            # The K splits' partial sums, BLOCK_P at a time: one load's latency, not P's.
            s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for p0 in range(0, P, BLOCK_P):
                ps = p0 + tl.arange(0, BLOCK_P)
                s_ptrs = (
                    s_ptr
                    + (ps[:, None, None] * T + rows[None, :, None]) * RA
                    + j * R
                    + rs[None, None, :]
                )
                s_mask = (ps < P)[:, None, None] & sm[None, :, :]
                s += tl.sum(tl.load(s_ptrs, mask=s_mask, other=0.0), axis=0)
            # NOTE: s is rounded to the weights' dtype first, as peft's lora_A output is.
            s16 = s.to(b_ptr.dtype.element_ty)
            for n0 in range(lo, hi, BLOCK_N):
                ns = n0 + tl.arange(0, BLOCK_N)
                n_mask = ns < hi
                b = tl.load(
                    b_slot + ns[None, :] * stride_bn + rs[:, None],
                    mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0,
                )
                out = tl.dot(s16, b, input_precision=PRECISION) * scale
                y_ptrs = y_ptr + rows[:, None] * stride_ym + ns[None, :]
                ym = m_mask[:, None] & n_mask[None, :]
                y = tl.load(y_ptrs, mask=ym, other=0.0)
                tl.store(y_ptrs, (y.to(tl.float32) + out).to(y.dtype), mask=ym)


def _check_segments(segments: torch.Tensor, rows: torch.Tensor | None) -> int:
    check_tensor("segments", segments, ndim=2, dtypes=(torch.int32,), contiguous=True)
    if segments.shape[0] != 3:
        raise ValueError(f"segments must be [3, num_segments], got {tuple(segments.shape)}")
    if rows is not None:
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int32,), contiguous=True)
    return segments.shape[1]


def _check_slots(name: str, w: torch.Tensor, dtype: torch.dtype) -> None:
    check_tensor(name, w, ndim=3, dtypes=(dtype,))


def _pow2(n: int, low: int) -> int:
    return max(low, triton.next_power_of_2(n))


def _block_m(max_seg_len: int) -> int:
    return TILE_ROWS if max_seg_len <= TILE_ROWS else 32


def _split_k(num_programs: int, k: int, block_k: int, block_m: int) -> int:
    """K splits for the shrink. Small tiles (decode): about 4 BLOCK_K tiles a program, whatever
    the grid (most of a CUDA graph's segments may be empty), at most 16 splits. Prefill: enough
    programs to fill the GPU (~256), each a few tiles long."""
    if block_m <= TILE_ROWS:
        return max(1, min(16, triton.cdiv(k, 4 * block_k)))
    want = max(1, 256 // max(1, num_programs))
    return max(1, min(want, k // (4 * block_k)))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    segments: torch.Tensor,
    max_seg_len: int,
    rows: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """x [T, K] @ A[slot]^T for the rows of every segment: float32 partial sums [P, T, RA]
    (P K splits; add them up for the product). Rows in no segment are left undefined.
    `max_seg_len` bounds every segment's count; `rows` maps positions to rows (None: same)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_slots("a", a, x.dtype)
    num_segs = _check_segments(segments, rows)
    check_devices(_shrink_kernel, x=x, a=a, segments=segments, rows=rows)
    T, K = x.shape
    RA = a.shape[1]
    if a.shape[2] != K:
        raise ValueError(f"a {tuple(a.shape)} does not fit x {tuple(x.shape)}")
    block_m, block_r = _block_m(max_seg_len), _pow2(RA, 16)
    if block_m <= TILE_ROWS:  # decode: wide K tiles, few of them (a latency-bound loop)
        block_k = max(64, min(256, 4096 // block_r))
    else:
        block_k = 64 if block_r <= 64 else 32
    m_tiles = triton.cdiv(max(1, max_seg_len), block_m)
    split = _split_k(num_segs * m_tiles, K, block_k, block_m)
    per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    s = torch.empty((split, T, RA), dtype=torch.float32, device=x.device)
    if num_segs:
        pdl = use_pdl(_shrink_kernel, x.device, pdl)
        _shrink_kernel[(m_tiles, num_segs, split)](
            x, a, s, segments, segments if rows is None else rows, num_segs, T, K, RA, per,
            x.stride(0), a.stride(0), a.stride(1),
            GATHER=rows is not None, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
            PRECISION=dot_precision(x.dtype), USE_PDL=pdl, **launch_options(pdl),
        )  # fmt: skip
    return s


def lora_expand(
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
    """y[t] += (sum_p s[p, t]) @ B[slot]^T * scales[slot] for the rows of every segment, in
    place. y [T, N] (rows may be strided), s [P, T, RA] float32, b [slots, N, R], scales
    [slots] float32; output columns of slice j (`slices`: widths, default one slice of N)
    read s's columns j*R .. (j+1)*R. `rows` as for `lora_shrink`."""
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("s", s, ndim=3, dtypes=(torch.float32,), contiguous=True)
    _check_slots("b", b, y.dtype)
    check_tensor("scales", scales, ndim=1, dtypes=(torch.float32,))
    num_segs = _check_segments(segments, rows)
    check_devices(_expand_kernel, y=y, s=s, b=b, scales=scales, segments=segments, rows=rows)
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
    block_m, block_r = _block_m(max_seg_len), _pow2(R, 16)
    # Decode tiles: a program walks 512 columns (most of a graph's segments may be empty, so
    # fewer, longer programs); prefill tiles: one BLOCK_N tile a program.
    block_n = 128 if block_m <= TILE_ROWS else 64
    n_per = 512 if block_m <= TILE_ROWS else block_n
    grid = (triton.cdiv(max(1, max_seg_len), block_m), num_segs, triton.cdiv(N, n_per))
    P = s.shape[0]
    block_p = min(triton.next_power_of_2(P), 16 if block_m <= TILE_ROWS else 2)
    pdl = use_pdl(_expand_kernel, y.device, pdl)
    _expand_kernel[grid](
        y, s, b, scales, segments, segments if rows is None else rows,
        num_segs, T, N, R, RA, P, n1, n2, n_per,
        y.stride(0), b.stride(0), b.stride(1),
        GATHER=rows is not None, SLICES=len(slices), BLOCK_M=block_m, BLOCK_R=block_r,
        BLOCK_N=block_n, BLOCK_P=block_p, PRECISION=dot_precision(y.dtype), USE_PDL=pdl,
        **launch_options(pdl),
    )  # fmt: skip
