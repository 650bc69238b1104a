"""FP8 (e4m3) activations for the FP8 GEMM: each row of x [M, K] scaled into e4m3's range by its
own float32 scale (amax / 448, dynamic per token) or by one static scale, in one kernel launch.
The kernels that produce a projection's input (RMSNorm, SwiGLU) can quantize their own output
with the same helpers (`row_scale`, `to_e4m3`), which saves this launch. The other way,
`e4m3_to_f16` widens an e4m3 tile (an FP8 KV cache's values) for a 16-bit dot.

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

__all__ = [
    "e4m3_to_f16",
    "fp8_rows_like",
    "quantize_rows",
    "quantize_rows_ref",
    "round_to_e4m3",
    "row_scale",
    "to_e4m3",
]


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
    ONE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if ONE_PASS:  # the whole row in one block: read it once
        ks = tl.arange(0, BLOCK)
        v = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(v), 0), static_ptr, STATIC)
        tl.store(scale_ptr + row, scale)
        q = to_e4m3(v, scale)
        tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        if not STATIC:
            for k0 in range(0, K, BLOCK):
                ks = k0 + tl.arange(0, BLOCK)
                v = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
        scale = row_scale(tl.max(amax, axis=0), static_ptr, STATIC)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            q = to_e4m3(v, scale)
            tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)


@triton.jit
def row_scale(amax, static_ptr, STATIC: tl.constexpr):
    """A row's float32 scale: its amax / 448 (floored, so a zero row divides by something), or
    the static scale at `static_ptr`. Shared by every kernel that quantizes rows, so that each
    computes what `quantize_rows_ref` does."""
    return tl.load(static_ptr).to(tl.float32) if STATIC else tl.maximum(amax / 448.0, 1e-12)


@triton.jit
def to_e4m3(v, scale):
    """v (float32) / scale, saturated to +-448 and rounded onto e4m3's grid (still float32: the
    caller casts, exactly)."""
    return round_to_e4m3(tl.minimum(tl.maximum(v / scale, -448.0), 448.0))


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


@triton.jit
def e4m3_to_f16(x):
    """e4m3 -> fp16 (exact), four values per register. NOTE: written as inline PTX, not `.to`,
    so that Triton widens the value tile where it is loaded and only then lays it out for the
    dot (fp16 through shared memory and ldmatrix.trans). With `.to` Triton moves the widening
    behind the layout change, and a dot operand of 8-bit values that vary fastest along the
    other dimension is then read from shared memory one byte per instruction: on an H100 an
    FP8 KV cache read 4-19% slower that way in decode attention (bench/fp8_kv_attention.py,
    same tiles). Not for the interpreter, which runs no PTX.
    `is_pure=False` is what keeps it in place: a pure elementwise op is moved as `.to` is."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }
        """,
        "=r,=r,r",
        [x],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


def quantize_rows(
    x: torch.Tensor, static_scale: torch.Tensor | None = None, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]); `static_scale` ([1],
    float32) replaces the per-row amax."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    rows, k = x.shape
    q, scales = fp8_rows_like(rows, k, x.device, static_scale)
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
        ONE_PASS=block >= k,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=8 if block >= 2048 else 4,
        **launch_options(pdl),
    )
    return q, scales


def fp8_rows_like(
    rows: int, k: int, device: torch.device, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty outputs of a row quantization (e4m3 [rows, k], float32 scales [rows, 1]), after
    checking a static scale."""
    if static_scale is not None:
        check_tensor("static_scale", static_scale, dtypes=(torch.float32,), shape=(1,))
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device)
    return q, torch.empty(rows, 1, dtype=torch.float32, device=device)
