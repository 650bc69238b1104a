"""The small kernels a model layer calls, behind one interface.

`TorchOps` is plain torch, written to match HF transformers operation for operation (so float32
outputs agree token for token); `TritonOps` runs the kernels in `kernels/` on a GPU. The
`Platform` picks one; the model never chooses by itself.

The `*_for` ops produce a projection's input and are told that projection's FP8 scales
(`feeds`): `TritonOps` then quantizes inside the kernel that produces the rows (RMSNorm,
SwiGLU) and hands `linear` an `FP8Rows`, one launch fewer per projection. At one row, where the
GEMV takes 16-bit input, it fuses SwiGLU into the gate/up GEMV instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from splitserve.engine.quantization import fp8_linear_ref
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.kernels.fp8_ref import skinny_fp8_gemm_ref

Scales = tuple[torch.Tensor | None, torch.Tensor | None]
"""(weight scale [N], static input scale [1]) of an FP8 projection; (None, None) otherwise."""
NO_SCALES: Scales = (None, None)


class FP8Rows(NamedTuple):
    """An FP8 projection's input, quantized per row by the kernel that produced it: e4m3 rows
    [M, K], their float32 scales [M, 1], and the 16-bit dtype the rows had (the product's)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


Activation = torch.Tensor | FP8Rows


class TorchOps:
    """The reference: every op in plain torch, on any device. Subclasses replace what they
    accelerate."""

    triton = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # NOTE: normalise in float32 and scale after casting back, exactly as HF does, so that
        # float32 outputs agree token for token and bf16 outputs agree within rounding.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rms_norm_for(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, feeds: Scales
    ) -> Activation:
        """`rms_norm` as the input of the projection whose scales are `feeds`."""
        return self.rms_norm(x, weight, eps)

    def add_rms_norm_for(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        feeds: Scales,
    ) -> tuple[Activation, torch.Tensor]:
        """`add_rms_norm` as the input of the projection whose scales are `feeds`."""
        return self.add_rms_norm(x, residual, weight, eps)

    def linear(
        self,
        x: Activation,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x @ weight^T + bias; an FP8 weight comes with its scales (engine/quantization.py)
        and is computed as the reference does: dequantized operands, float32 accumulation."""
        if isinstance(x, FP8Rows):
            if weight_scale is None:
                raise TypeError("quantized rows need an FP8 weight")
            return skinny_fp8_gemm_ref(x.q, x.scale, weight, weight_scale, bias, out_dtype=x.dtype)
        if weight_scale is not None:
            return fp8_linear_ref(x, weight, weight_scale, bias, input_scale)
        return F.linear(x, weight, bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * I] (gate | up) -> silu(gate) * up."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gate_up_silu(
        self, x: Activation, weight: torch.Tensor, scales: Scales, feeds: Scales
    ) -> Activation:
        """silu(gate) * up of the merged gate/up projection, as the input of the projection
        whose scales are `feeds`."""
        return self.silu_and_mul(self.linear(x, weight, None, *scales))

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, q, k)

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        activation: str,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts of a Mixture-of-Experts block (engine/moe.py), each token through its
        top-k experts and summed with their routing weights: kernels/moe_ref.py. With scales,
        FP8 expert weights (weight-only: x stays in its dtype)."""
        from splitserve.kernels.moe_ref import fused_moe_ref

        return fused_moe_ref(
            x, w13, w2, topk_ids, topk_weights,
            activation=activation, w13_bias=w13_bias, w2_bias=w2_bias,
            w13_scale=w13_scale, w2_scale=w2_scale,
        )  # fmt: skip

    def moe_route(
        self, logits: torch.Tensor, top_k: int, router: str, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A Mixture-of-Experts router's (weights, expert ids) [T, k] from its logits [T, E], in
        transformers' order: kernels/moe_ref.py."""
        from splitserve.kernels.moe_ref import moe_route_ref

        return moe_route_ref(logits, top_k, router, renormalize)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


class TritonOps(TorchOps):
    """The kernels in `kernels/` (imported on first use, so the CPU never loads them)."""

    triton = True

    def __init__(self, pdl: bool) -> None:
        self.pdl = pdl

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from splitserve.kernels.rmsnorm import rms_norm

        return rms_norm(x, weight, eps, pdl=self.pdl)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from splitserve.kernels.rmsnorm import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps, pdl=self.pdl)

    def rms_norm_for(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, feeds: Scales
    ) -> Activation:
        if not _quantizes_ahead(x, feeds) or weight.dtype != x.dtype:
            return self.rms_norm(x, weight, eps)
        from splitserve.kernels.rmsnorm import rms_norm_fp8

        q, scale = rms_norm_fp8(x, weight, eps, feeds[1], pdl=self.pdl)
        return FP8Rows(q, scale, x.dtype)

    def add_rms_norm_for(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        feeds: Scales,
    ) -> tuple[Activation, torch.Tensor]:
        if not _quantizes_ahead(x, feeds) or weight.dtype != x.dtype:
            return self.add_rms_norm(x, residual, weight, eps)
        from splitserve.kernels.rmsnorm import fused_add_rms_norm_fp8

        q, scale, residual = fused_add_rms_norm_fp8(
            x, residual, weight, eps, feeds[1], pdl=self.pdl
        )
        return FP8Rows(q, scale, x.dtype), residual

    def linear(
        self,
        x: Activation,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # A single row (batch-1 decode) goes to the streaming GEMV kernel, which beats cuBLAS
        # there (bench/gemv.py); cuBLAS keeps every larger bf16 batch. FP8: the GEMV reads the
        # FP8 weight and scales each output (the activation stays 16-bit: one row costs nothing
        # to read); more rows are quantized per token for FP8 tensor cores, up to MAX_ROWS in
        # the skinny kernel that streams the weight (bench/fp8_gemm.py), above in _scaled_mm.
        # Rows quantized by the kernel that made them (FP8Rows) skip the quantization here.
        if isinstance(x, FP8Rows):
            if weight_scale is None:
                raise TypeError("quantized rows need an FP8 weight")
            return self._fp8_matmul(x, weight, weight_scale, bias)
        if x.shape[0] == 1:
            from splitserve.kernels.gemv import gemv

            return gemv(x, weight, bias, weight_scale=weight_scale, pdl=self.pdl)
        if weight_scale is not None:
            from splitserve.kernels.fp8_quant import quantize_rows

            xq, xs = quantize_rows(x, input_scale, pdl=self.pdl)
            return self._fp8_matmul(FP8Rows(xq, xs, x.dtype), weight, weight_scale, bias)
        return F.linear(x, weight, bias)

    def _fp8_matmul(
        self,
        x: FP8Rows,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        from splitserve.kernels.fp8_skinny import MAX_ROWS, skinny_fp8_gemm

        if x.q.shape[0] <= MAX_ROWS:
            return skinny_fp8_gemm(
                x.q, x.scale, weight, weight_scale, bias, out_dtype=x.dtype, pdl=self.pdl
            )
        return fp8_scaled_mm(x.q, x.scale, weight, weight_scale, bias, x.dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        from splitserve.kernels.activation import silu_and_mul

        return silu_and_mul(x, pdl=self.pdl)

    def gate_up_silu(
        self, x: Activation, weight: torch.Tensor, scales: Scales, feeds: Scales
    ) -> Activation:
        if isinstance(x, torch.Tensor) and x.shape[0] == 1:
            from splitserve.kernels.gemv import gemv

            return gemv(x, weight, weight_scale=scales[0], swiglu=True, pdl=self.pdl)
        h = self.linear(x, weight, None, *scales)
        if not _quantizes_ahead(h, feeds):
            return self.silu_and_mul(h)
        from splitserve.kernels.activation import silu_and_mul_fp8

        q, scale = silu_and_mul_fp8(h, feeds[1], pdl=self.pdl)
        return FP8Rows(q, scale, h.dtype)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from splitserve.kernels.rotary import rotary_embedding

        return rotary_embedding(positions, q, k, rotary.cos, rotary.sin, pdl=self.pdl)

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        activation: str,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from splitserve.kernels.fused_moe import fused_moe

        return fused_moe(
            x, w13, w2, topk_ids.contiguous(), topk_weights.contiguous(),
            activation=activation, w13_bias=w13_bias, w2_bias=w2_bias,
            w13_scale=w13_scale, w2_scale=w2_scale, pdl=self.pdl,
        )  # fmt: skip

    def moe_route(
        self, logits: torch.Tensor, top_k: int, router: str, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from splitserve.kernels.moe_route import moe_route

        return moe_route(logits.contiguous(), top_k, router, renormalize, pdl=self.pdl)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        from splitserve.kernels.argmax import argmax_rows

        return argmax_rows(logits, pdl=self.pdl)


def _quantizes_ahead(x: torch.Tensor, feeds: Scales) -> bool:
    """Whether x's producer quantizes it for its consumer: an FP8 projection (weight scale
    given) of more than one row (one row goes to the GEMV, which reads 16-bit input)."""
    return feeds[0] is not None and x.dim() == 2 and x.shape[0] > 1


def fp8_scaled_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """FP8 tensor cores: quantized rows [M, K] with their scales [M, 1] times the FP8 weight
    [N, K] with its per-channel scales, both applied inside the GEMM (`torch._scaled_mm`,
    rowwise), accumulated in float32."""
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :], out_dtype=out_dtype
    )
    return out if bias is None else out + bias
