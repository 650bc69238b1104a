"""SwiGLU's gate: silu(x[:, :I]) * x[:, I:] for the fused gate/up projection output [T, 2I].

silu runs in float32 and is rounded to the input dtype before the product, as torch's
`F.silu(gate) * up` rounds, so 16-bit results match the unfused MLP.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


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
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate_size + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(
        out_ptr + row * stride_o + cols,
        (silu.to(tl.float32) * up.to(tl.float32)).to(dtype),
        mask=mask,
    )


def silu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """x: [T, 2 * I] (gate | up) -> out [T, I] = silu(gate) * up, in x's dtype."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dimension must be even (gate | up), got {width}")
    intermediate_size = width // 2
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


def silu_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch `silu_and_mul`: engine/model.py's MLP gate."""
    half = x.shape[-1] // 2
    result = torch.nn.functional.silu(x[:, :half]) * x[:, half:]
    if out is None:
        return result
    return out.copy_(result)
