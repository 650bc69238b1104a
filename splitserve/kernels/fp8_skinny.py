"""FP8 matmul for a few rows (decode at batch 2-64): out[M, N] = (xq * xs) @ (w * ws)^T + bias.

At these batches a matmul still reads every weight once and does little arithmetic, so it should
stream the FP8 weight at bandwidth, as the batch-1 GEMV (kernels/gemv.py) does. Rowwise
`torch._scaled_mm` reads qkv, o and down at only 30-45% of copy bandwidth there
(bench/fp8_gemm.py): its tiles are shaped for the rows, and a short projection (N = 4096) makes
too few of them to keep every SM reading.

Here the operands are swapped: the weight is the wide side of the FP8 tensor-core product
(BLOCK_N = 64 or 128 output channels, a Hopper warpgroup MMA's M), the few quantized rows the
narrow side (BLOCK_M >= 16), both read straight into shared memory with no widening; the
tensor cores' partial sums move into float32 every ACC_SPAN products along K. A
projection with few channel tiles is split along K (SPLIT_K programs per tile, each summing a
K range into float32); the partial sums go to a workspace, and the program that finishes a tile
last (an atomic counter per tile) adds them in a fixed order, so the result is deterministic,
and resets the counter for the next launch. Scales and bias are applied once, at the end.

NOTE: the workspace and counters are per device and reused by every call, which is safe when
the calls are ordered on one stream (the engine's); two streams must not run this at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor, is_interpreted
from splitserve.kernels.fp8_ref import skinny_fp8_gemm_ref
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = ["MAX_ROWS", "pick_config", "skinny_fp8_gemm", "skinny_fp8_gemm_ref", "split_for"]

MAX_ROWS = 64
"""The most rows `TritonOps.linear` sends here; more go to rowwise `_scaled_mm`."""

MAX_BLOCK_M = 64
"""The most rows one program takes; more rows make more row tiles."""

ACC_SPAN = 128
"""K elements the FP8 tensor cores sum before the partial sum is added into float32 (as
DeepGEMM does). NOTE: given 0 ("after every MMA"), Triton compiles no FP8 MMA at all for sm_90:
it widens both operands to fp16 for `mma.sync` (seen in its IR)."""

FP8 = torch.float8_e4m3fn


@triton.jit
def _skinny_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    K_SPLIT,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACC_SPAN: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # NOTE: row tiles vary fastest, so the programs that share a weight tile run together and
    # all but the first find it in L2: the weight is read from memory once however many rows.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = cols_n < N
    m_mask = rows_m < M
    k_start = pid_k * K_SPLIT
    ks = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols_n.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + rows_m.to(tl.int64)[None, :] * stride_xm + ks[:, None]  # x^T [K, M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if EVEN_K:  # every split is whole tiles of K
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            k_mask = (ks + k0 < K) & (k0 + tl.arange(0, BLOCK_K) < K_SPLIT)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        if WIDEN:  # the interpreter has no FP8 dot: every e4m3 product is exact in float32
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:  # NOTE: Hopper's FP8 MMA sums in fewer bits than float32: promote every ACC_SPAN
            acc = tl.dot(w, x, acc, max_num_imprecise_acc=ACC_SPAN)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    last = True
    if SPLIT_K > 1:
        rows_pad = tl.num_programs(0) * BLOCK_M
        tile = pid_n * tl.num_programs(0) + pid_m
        parts = part_ptr + (rows_m[None, :] * N + cols_n[:, None]).to(tl.int64)
        tl.store(parts + pid_k.to(tl.int64) * rows_pad * N, acc, mask=n_mask[:, None])
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT_K - 1
        if last:  # the last program of this tile sums the parts in order
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(
                    parts + s * rows_pad * N, mask=n_mask[:, None], other=0.0, cache_modifier=".cg"
                )
            tl.atomic_xchg(count_ptr + tile, 0)
    if last:
        acc *= tl.load(w_scale_ptr + cols_n, mask=n_mask, other=0.0)[:, None]
        acc *= tl.load(x_scale_ptr + rows_m, mask=m_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + rows_m.to(tl.int64)[None, :] * stride_om + cols_n[:, None]
        out_mask = n_mask[:, None] & m_mask[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def pick_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for [m, k] x [n, k]^T.

    NOTE: from `python -m bench.fp8_gemm --rows 1,8,64,128,256 --sweep` on an H100 (Llama-3-8B
    projections, FP8 tensor-core MMA). BLOCK_M covers all rows in one program, so the weight is
    read once. (Past MAX_BLOCK_M rows, where only the benchmark goes, the rows take several
    tiles that share each weight tile through L2; at 128 rows the best tiles only tie
    `_scaled_mm`, docs/benchmarks.md section 9.) 64 channels by 256-wide K tiles won for every
    projection at 8 and 64 rows. A short projection (qkv, o, down: 64-96 tiles) is split along
    K up to about 256 programs (qkv in two, o and down in four); gate_up (448 tiles) needs no
    split. Four stages won at 8 rows, three at 64, where four would leave one program per SM.
    """
    block_m = max(16, triton.next_power_of_2(min(m, MAX_BLOCK_M)))
    block_n, block_k = 64, 256
    split = split_for(m, n, k, block_m, block_n, block_k, 256)
    return block_m, block_n, block_k, split, 4, 4 if block_m <= 32 else 3


def split_for(
    m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, programs: int
) -> int:
    """How many ways to split K: none when the tiles already fill a wave of an H100's 132 SMs,
    else the largest power of two that keeps the grid within `programs` and gives each program
    at least two K tiles."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    limit = min(programs // tiles, k // (2 * block_k))
    if tiles >= 132 or limit < 2:
        return 1
    return 1 << (limit.bit_length() - 1)


_WORKSPACES: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _workspace(device: torch.device, parts: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 partial sums and zeroed int32 counters of at least these sizes. A buffer that
    is outgrown is kept, never freed: a captured CUDA graph may still point at it."""
    held = _WORKSPACES.setdefault(device, [])
    if not held or held[-1][0].numel() < parts or held[-1][1].numel() < tiles:
        size = max(parts, held[-1][0].numel() if held else 0)
        count = max(tiles, held[-1][1].numel() if held else 0)
        held.append(
            (
                torch.empty(size, dtype=torch.float32, device=device),
                torch.zeros(count, dtype=torch.int32, device=device),
            )
        )
    return held[-1]


def skinny_fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, int, int, int, int, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """xq [M, K] float8_e4m3fn with its row scales `x_scale` [M, 1] (kernels/fp8_quant.py),
    weight [N, K] float8_e4m3fn with `weight_scale` [N] (float32), bias [N] -> [M, N] in
    `out_dtype`, accumulated in float32. `config` overrides `pick_config`."""
    check_tensor("xq", xq, ndim=2, dtypes=(FP8,))
    check_tensor("weight", weight, ndim=2, dtypes=(FP8,))
    rows, width = xq.shape
    n, k = weight.shape
    if width != k:
        raise ValueError(f"xq has {width} columns, weight {tuple(weight.shape)} needs {k}")
    check_tensor("x_scale", x_scale, dtypes=(torch.float32,), shape=(rows, 1), contiguous=True)
    check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,), shape=(n,))
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(out_dtype,), shape=(n,))
    out = torch.empty(rows, n, dtype=out_dtype, device=xq.device)
    check_devices(
        _skinny_kernel, xq=xq, x_scale=x_scale, weight=weight, weight_scale=weight_scale, bias=bias
    )
    if rows == 0 or n == 0:
        return out
    block_m, block_n, block_k, split, num_warps, num_stages = config or pick_config(rows, n, k)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n), split)
    k_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    parts, counts = _workspace(xq.device, split * grid[0] * block_m * n, grid[0] * grid[1])
    pdl = use_pdl(_skinny_kernel, xq.device, pdl)
    _skinny_kernel[grid](
        xq,
        x_scale,
        weight,
        weight_scale,
        bias if bias is not None else out,
        out,
        parts,
        counts,
        rows,
        n,
        k,
        k_split,
        xq.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k_split * split == k,
        SPLIT_K=split,
        WIDEN=is_interpreted(_skinny_kernel),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ACC_SPAN=min(block_k, ACC_SPAN),
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    return out
