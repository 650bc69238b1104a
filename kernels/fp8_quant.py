"""FP8 (e4m3) activations for the FP8 GEMM: each row of x [M, K] scaled into e4m3's range by its
own float32 scale (amax / 448, dynamic per token) or by one static scale, in one kernel launch.

`torch` would take six launches for the same (abs, amax, divide, clamp, cast, and the scale);
in a decode step's CUDA graph that is six launches per projection, which at batch 8 cost more
than the FP8 GEMM saves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor
from splitserve.kernels.fp8_ref import quantize_rows_ref
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = ["quantize_rows", "quantize_rows_ref", "round_to_e4m3"]


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    K,
    stride_x,
    stride_q,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.minimum(tl.maximum(v / scale, -448.0), 448.0))
        tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)


@triton.jit
def round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to nearest-even on e4m3's grid, so the cast after it is
    exact. Normal range: drop 20 of float32's 23 mantissa bits with the carry going into the
    exponent (the trick float32 -> bfloat16 uses); below 2^-6 the grid is 2^-9 apart.

    NOTE: the cast could round by itself on the GPU, but Triton's interpreter (the CPU tests)
    truncates where a rounding carries into the exponent (126.6 -> 64, not 128)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & -0x100000).to(tl.float32, bitcast=True)
    tiny = ((tl.abs(v) * 512.0 + 12582912.0) - 12582912.0) / 512.0  # rint(|v| * 2^9) / 2^9
    sign = bits & -0x80000000  # NOTE: keeps -0.0 (and tiny negatives rounding to it) negative
    tiny = (tiny.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < 0.015625, tiny, normal)


def quantize_rows(
    x: torch.Tensor, static_scale: torch.Tensor | None = None, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]); `static_scale` ([1],
    float32) replaces the per-row amax."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if static_scale is not None:
        check_tensor("static_scale", static_scale, dtypes=(torch.float32,), shape=(1,))
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    check_devices(_quantize_rows_kernel, x=x, static_scale=static_scale)
    if rows == 0:
        return q, scales
    pdl = use_pdl(_quantize_rows_kernel, x.device, pdl)
    block = min(4096, triton.next_power_of_2(max(k, 16)))
    _quantize_rows_kernel[(rows,)](
        x,
        q,
        scales,
        static_scale if static_scale is not None else scales,
        k,
        x.stride(0),
        q.stride(0),
        STATIC=static_scale is not None,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=8 if block >= 2048 else 4,
        **launch_options(pdl),
    )
    return q, scales
