"""SwiGLU's gate: silu(x[:, :I]) * x[:, I:] for the fused gate/up projection output [T, 2I].

silu runs in float32 and is rounded to the input dtype before the product, as torch's
`F.silu(gate) * up` rounds, so 16-bit results match the unfused MLP.

`silu_and_mul_fp8` quantizes that product per row for an FP8 down projection (what
kernels/fp8_quant.py's `quantize_rows` would do after it, minus its launch). One program owns a
row, whole in one block up to ONE_PASS_MAX wide (else the product is computed twice, once for
the row's amax and once to quantize); the 16-bit product is never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor
from splitserve.kernels.fp8_quant import fp8_rows_like, row_scale, to_e4m3
from splitserve.kernels.fp8_ref import quantize_rows_ref
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = ["silu_and_mul", "silu_and_mul_fp8", "silu_and_mul_fp8_ref", "silu_and_mul_ref"]

ONE_PASS_MAX = 16384  # the widest row `silu_and_mul_fp8` reads once (one block per program)


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up as torch rounds it in `dtype` (gate and up: loaded in `dtype`)."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + intermediate_size + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up, x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    intermediate_size,
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
    q_row = q_ptr + row * stride_q
    dtype = x_ptr.dtype.element_ty
    if ONE_PASS:  # the whole row in one block: read it once
        cols = tl.arange(0, BLOCK)
        mask = cols < intermediate_size
        gate = tl.load(x_row + cols, mask=mask, other=0.0)
        up = tl.load(x_row + intermediate_size + cols, mask=mask, other=0.0)
        h = silu_mul(gate, up, dtype).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(h), 0), static_ptr, STATIC)
        tl.store(scale_ptr + row, scale)
        tl.store(q_row + cols, to_e4m3(h, scale).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        if not STATIC:
            for c0 in range(0, intermediate_size, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                mask = cols < intermediate_size
                gate = tl.load(x_row + cols, mask=mask, other=0.0)
                up = tl.load(x_row + intermediate_size + cols, mask=mask, other=0.0)
                amax = tl.maximum(amax, tl.abs(silu_mul(gate, up, dtype).to(tl.float32)))
        scale = row_scale(tl.max(amax, axis=0), static_ptr, STATIC)
        tl.store(scale_ptr + row, scale)
        for c0 in range(0, intermediate_size, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < intermediate_size
            gate = tl.load(x_row + cols, mask=mask, other=0.0)
            up = tl.load(x_row + intermediate_size + cols, mask=mask, other=0.0)
            q = to_e4m3(silu_mul(gate, up, dtype).to(tl.float32), scale)
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def _intermediate_size(x: torch.Tensor) -> int:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"x's last dimension must be even (gate | up), got {x.shape[1]}")
    return x.shape[1] // 2


def silu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """x: [T, 2 * I] (gate | up) -> out [T, I] = silu(gate) * up, in x's dtype."""
    intermediate_size = _intermediate_size(x)
    num_tokens = x.shape[0]
    if out is None:
        out = x.new_empty((num_tokens, intermediate_size))
    check_tensor("out", out, dtypes=(x.dtype,), shape=(num_tokens, intermediate_size))
    check_devices(_silu_and_mul_kernel, x=x, out=out)
    if num_tokens == 0 or intermediate_size == 0:
        return out
    block = min(1024, triton.next_power_of_2(intermediate_size))
    grid = (num_tokens, triton.cdiv(intermediate_size, block))
    pdl = use_pdl(_silu_and_mul_kernel, x.device, pdl)
    _silu_and_mul_kernel[grid](
        x,
        out,
        intermediate_size,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=4 if block >= 512 else 1,
        **launch_options(pdl),
    )
    return out


def silu_and_mul_fp8(
    x: torch.Tensor, static_scale: torch.Tensor | None = None, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2 * I] (gate | up) -> silu(gate) * up quantized per row: (e4m3 [T, I], float32
    scales [T, 1]), each row by its amax / 448 or all by `static_scale` ([1], float32)."""
    intermediate_size = _intermediate_size(x)
    num_tokens = x.shape[0]
    q, scales = fp8_rows_like(num_tokens, intermediate_size, x.device, static_scale)
    check_devices(_silu_and_mul_fp8_kernel, x=x, static_scale=static_scale)
    if num_tokens == 0 or intermediate_size == 0:
        return q, scales
    # NOTE: up to 16384 wide (Llama-3-8B's 14336) a program holds the whole row; a loop over
    # blocks reads it twice, a chain of dependent loads that at batch 8 took longer than the
    # separate SwiGLU and quantization launches it replaces.
    block = min(ONE_PASS_MAX, triton.next_power_of_2(max(intermediate_size, 16)))
    pdl = use_pdl(_silu_and_mul_fp8_kernel, x.device, pdl)
    _silu_and_mul_fp8_kernel[(num_tokens,)](
        x,
        q,
        scales,
        static_scale if static_scale is not None else scales,
        intermediate_size,
        x.stride(0),
        q.stride(0),
        STATIC=static_scale is not None,
        ONE_PASS=block >= intermediate_size,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=min(max(block // 512, 4), 16),
        **launch_options(pdl),
    )
    return q, scales


def silu_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch `silu_and_mul`: engine/model.py's MLP gate."""
    half = x.shape[-1] // 2
    result = torch.nn.functional.silu(x[:, :half]) * x[:, half:]
    if out is None:
        return result
    return out.copy_(result)


def silu_and_mul_fp8_ref(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `silu_and_mul_fp8`: the product, then `quantize_rows_ref`."""
    return quantize_rows_ref(silu_and_mul_ref(x), static_scale)
