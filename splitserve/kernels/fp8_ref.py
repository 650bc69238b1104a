"""FP8 (e4m3) arithmetic in plain torch, no Triton: what the FP8 kernels are checked against and
what the engine's torch path runs, so the two share one definition."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def saturate_fp8(x: torch.Tensor) -> torch.Tensor:
    """x as e4m3 holds it: values past +-448 saturate (a plain cast would make them NaN), the
    rest round to nearest even."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows_ref(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): each row by its own amax / 448, or all
    by `static_scale` ([1])."""
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    else:
        scale = static_scale.float().reshape(1, 1).expand(xf.shape[0], 1).contiguous()
    return saturate_fp8(xf / scale), scale


def skinny_fp8_gemm_ref(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Plain torch: both operands dequantized to float32, multiplied, biased, rounded once
    (the arithmetic of `engine.quantization.fp8_linear_ref` after its activation quantization)."""
    out = (xq.float() * x_scale) @ (weight.float() * weight_scale.float()[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
