"""RMSNorm and fused residual-add + RMSNorm, one program per row.

Numerics follow HF (and engine/model.py's RMSNorm): the mean square and the scaling run in
float32, the result is cast back to the input dtype and only then multiplied by the weight, in
the dtype torch would promote the two to. So float32 agrees with the model, and 16-bit dtypes
round at the same places.

The `_fp8` variants quantize that result per row for an FP8 projection (what
kernels/fp8_quant.py's `quantize_rows` would do after it, minus its launch): they return e4m3
rows and their float32 scales, and never write the 16-bit result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor
from splitserve.kernels.fp8_quant import fp8_rows_like, row_scale, to_e4m3
from splitserve.kernels.fp8_ref import quantize_rows_ref
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_fp8",
    "fused_add_rms_norm_fp8_ref",
    "fused_add_rms_norm_ref",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_fp8_ref",
    "rms_norm_ref",
]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    scale_ptr,
    static_ptr,
    hidden_size,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    ADD_RESIDUAL: tl.constexpr,
    FP8: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # The sum is rounded to the input dtype, as the model's `x + attn(x)` is.
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, 0) / hidden_size
    h = (h * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    # NOTE: FP8 output needs weight.dtype == x.dtype (checked by the caller): that is the dtype
    # the 16-bit result would have had.
    norm_dtype = x_ptr.dtype.element_ty if FP8 else out_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(norm_dtype)
    y = (h.to(norm_dtype) * w).to(norm_dtype)
    if FP8:
        yf = y.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(yf), 0), static_ptr, STATIC)
        tl.store(scale_ptr + row, scale)
        y = to_e4m3(yf, scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def _as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> a [rows, hidden] view (no copy) with unit stride along hidden."""
    check_tensor(name, t, dtypes=FLOAT_DTYPES)
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as err:
        raise ValueError(f"{name} of strides {t.stride()} cannot be viewed as rows") from err


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    pdl: bool,
    fp8: bool = False,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out, residual_out, FP8 scales or None)."""
    hidden = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 0
    x_rows = _as_rows("x", x)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, shape=(hidden,))
    scales = None
    if fp8:
        if weight.dtype != x.dtype:
            raise ValueError(f"FP8 output needs weight in x's dtype {x.dtype}, got {weight.dtype}")
        out, scales = fp8_rows_like(x_rows.shape[0], hidden, x.device, static_scale)
        out_rows = out
    else:
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        if out is None:
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        check_tensor("out", out, dtypes=(out_dtype,), shape=tuple(x.shape))
        out_rows = _as_rows("out", out)
    res_rows = res_out_rows = x_rows
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape))
        if residual_out is None:
            residual_out = torch.empty_like(x)
        check_tensor("residual_out", residual_out, dtypes=(x.dtype,), shape=tuple(x.shape))
        res_rows, res_out_rows = (
            _as_rows("residual", residual),
            _as_rows("residual_out", residual_out),
        )
    check_devices(
        _rms_norm_kernel,
        x=x,
        residual=residual,
        weight=weight,
        out=out,
        residual_out=residual_out,
        static_scale=static_scale,
    )
    num_rows = x_rows.shape[0]
    if num_rows == 0 or hidden == 0:
        return out, residual_out, scales
    block = triton.next_power_of_2(hidden)
    pdl = use_pdl(_rms_norm_kernel, x.device, pdl)
    _rms_norm_kernel[(num_rows,)](
        x_rows,
        res_rows,
        weight,
        out_rows,
        res_out_rows,
        scales if scales is not None else x_rows,
        static_scale if static_scale is not None else x_rows,
        hidden,
        eps,
        x_rows.stride(0),
        res_rows.stride(0),
        out_rows.stride(0),
        res_out_rows.stride(0),
        ADD_RESIDUAL=residual is not None,
        FP8=fp8,
        STATIC=static_scale is not None,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=min(max(block // 512, 1), 16),
        **launch_options(pdl),
    )
    return out, residual_out, scales


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dimension; x: [..., hidden]."""
    normed, _, _ = _launch(x, None, weight, eps, out, None, pdl)
    return normed


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass. Outputs may alias the inputs (each
    row is read whole before it is written), e.g. `residual_out=residual` updates in place."""
    normed, new_residual, _ = _launch(x, residual, weight, eps, out, residual_out, pdl)
    assert new_residual is not None
    return normed, new_residual


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    static_scale: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` of x [..., hidden] quantized per row: (e4m3 [rows, hidden], float32 scales
    [rows, 1]), each row by its amax / 448 or all by `static_scale` ([1], float32)."""
    q, _, scales = _launch(x, None, weight, eps, None, None, pdl, True, static_scale)
    assert scales is not None
    return q, scales


def fused_add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    static_scale: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm` with the normed rows quantized as `rms_norm_fp8` does:
    (e4m3 rows, their scales, x + residual)."""
    q, new_residual, scales = _launch(
        x, residual, weight, eps, None, residual_out, pdl, True, static_scale
    )
    assert new_residual is not None and scales is not None
    return q, scales, new_residual


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch `rms_norm`: engine/model.py's RMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    result = weight * h.to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `fused_add_rms_norm`."""
    added = x + residual
    if residual_out is not None:
        added = residual_out.copy_(added)
    return rms_norm_ref(added, weight, eps, out), added


def rms_norm_fp8_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `rms_norm_fp8`: the norm, then `quantize_rows_ref`."""
    normed = rms_norm_ref(x, weight, eps)
    return quantize_rows_ref(normed.reshape(-1, normed.shape[-1]), static_scale)


def fused_add_rms_norm_fp8_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch `fused_add_rms_norm_fp8`."""
    normed, added = fused_add_rms_norm_ref(x, residual, weight, eps)
    q, scales = quantize_rows_ref(normed.reshape(-1, normed.shape[-1]), static_scale)
    return q, scales, added
