"""RMSNorm and fused residual-add + RMSNorm, one program per row.

Numerics follow HF (and engine/model.py's RMSNorm): the mean square and the scaling run in
float32, the result is cast back to the input dtype and only then multiplied by the weight, in
the dtype torch would promote the two to. So float32 agrees with the model, and 16-bit dtypes
round at the same places.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_ref", "rms_norm", "rms_norm_ref"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden_size,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    ADD_RESIDUAL: tl.constexpr,
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
    out_dtype = out_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(out_dtype)
    tl.store(out_ptr + row * stride_o + cols, (h.to(out_dtype) * w).to(out_dtype), mask=mask)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 0
    x_rows = _as_rows("x", x)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, shape=(hidden,))
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
        _rms_norm_kernel, x=x, residual=residual, weight=weight, out=out, residual_out=residual_out
    )
    num_rows = x_rows.shape[0]
    if num_rows == 0 or hidden == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    pdl = use_pdl(_rms_norm_kernel, x.device, pdl)
    _rms_norm_kernel[(num_rows,)](
        x_rows,
        res_rows,
        weight,
        out_rows,
        res_out_rows,
        hidden,
        eps,
        x_rows.stride(0),
        res_rows.stride(0),
        out_rows.stride(0),
        res_out_rows.stride(0),
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=min(max(block // 512, 1), 16),
        **launch_options(pdl),
    )
    return out, residual_out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dimension; x: [..., hidden]."""
    normed, _ = _launch(x, None, weight, eps, out, None, pdl)
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
    normed, new_residual = _launch(x, residual, weight, eps, out, residual_out, pdl)
    assert new_residual is not None
    return normed, new_residual


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
