"""The kernels that make an FP8 projection's input quantize it themselves (RMSNorm, add + RMSNorm,
SwiGLU), and the batch-1 GEMV fuses SwiGLU behind gate/up: each gives bit for bit what the
unfused launches give (the same kernels' arithmetic, in one launch), and the torch reference
within e4m3's rounding. Then the model's MLP and norms, through `TritonOps`, against the same
layers with nothing fused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitserve.engine.quantization import quantize_weight
from splitserve.kernels.activation import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref
from splitserve.kernels.fp8_quant import quantize_rows
from splitserve.kernels.gemv import gemv, gemv_ref
from splitserve.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_fp8,
    fused_add_rms_norm_fp8_ref,
    rms_norm,
    rms_norm_fp8,
    rms_norm_fp8_ref,
)
from tests.kernels.paged_inputs import DTYPES

STATIC = torch.tensor([0.004])


def _static(static: bool, device: torch.device) -> torch.Tensor | None:
    return STATIC.to(device) if static else None


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    assert got[0].dtype == torch.float8_e4m3fn and got[0].shape == want[0].shape
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def _close_to_ref(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]):
    """Within e4m3's rounding of the reference (as tests/kernels/test_fp8_quant.py allows: the
    16-bit input may differ by one rounding, so a value can land one e4m3 step away)."""
    torch.testing.assert_close(got[1], ref[1], rtol=0.02, atol=0)
    deq, deq_ref = got[0].float() * got[1], ref[0].float() * ref[1]
    torch.testing.assert_close(deq, deq_ref, rtol=0.13, atol=0.02 * float(ref[1].max()))


def _rows(m: int, k: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(m, k, generator=gen)).to(device, dtype)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), [(2, 64), (5, 100)])
def test_rms_norm_fp8_is_the_norm_then_quantize_rows(m, k, dtype, static, device):
    x, residual = _rows(m, k, dtype, device, k), _rows(m, k, dtype, device, k + 1)
    weight = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(m))).to(
        device, dtype
    )
    scale = _static(static, device)

    got = rms_norm_fp8(x, weight, 1e-6, scale)
    _same(got, quantize_rows(rms_norm(x, weight, 1e-6), scale))
    _close_to_ref(got, rms_norm_fp8_ref(x, weight, 1e-6, scale))

    q, s, added = fused_add_rms_norm_fp8(x, residual, weight, 1e-6, scale)
    normed, want_added = fused_add_rms_norm(x, residual, weight, 1e-6)
    _same((q, s), quantize_rows(normed, scale))
    assert torch.equal(added, want_added)
    q_ref, s_ref, added_ref = fused_add_rms_norm_fp8_ref(x, residual, weight, 1e-6, scale)
    _close_to_ref((q, s), (q_ref, s_ref))
    assert torch.equal(added, added_ref)


def test_rms_norm_fp8_wants_the_weight_in_the_input_dtype(device):
    x = torch.randn(2, 16, device=device)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_fp8(x, torch.ones(16, device=device, dtype=torch.float16), 1e-6)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
# 16500: wider than one block (ONE_PASS_MAX), so the row is read twice
@pytest.mark.parametrize(("m", "intermediate"), [(3, 100), (2, 2500), (2, 16500)])
def test_silu_and_mul_fp8_is_the_product_then_quantize_rows(m, intermediate, dtype, static, device):
    x = _rows(m, 2 * intermediate, dtype, device, intermediate)
    scale = _static(static, device)
    got = silu_and_mul_fp8(x, scale)
    _same(got, quantize_rows(silu_and_mul(x), scale))
    _close_to_ref(got, silu_and_mul_fp8_ref(x, scale))


def test_silu_and_mul_fp8_rejects_odd_widths_and_bad_scales(device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_fp8(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="static_scale"):
        silu_and_mul_fp8(torch.randn(2, 8, device=device), torch.ones(2, device=device))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("intermediate", "k", "bias"), [(40, 96, False), (33, 700, True)])
def test_swiglu_gemv_is_the_gemv_then_silu_and_mul(intermediate, k, bias, dtype, fp8, device):
    gen = torch.Generator().manual_seed(intermediate + k)
    x = torch.randn(1, k, generator=gen).to(device, dtype)
    w = torch.randn(2 * intermediate, k, generator=gen) / k**0.5
    scale = None
    if fp8:
        w, scale = quantize_weight(w)
        scale = scale.to(device)
    w = w.to(device) if fp8 else w.to(device, dtype)
    b = torch.randn(2 * intermediate, generator=gen).to(device, dtype) if bias else None
    for config in (None, (8, 256, 4)):
        got = gemv(x, w, b, weight_scale=scale, swiglu=True, config=config)
        plain = gemv(x, w, b, weight_scale=scale, config=config)
        assert got.shape == (1, intermediate)
        assert torch.equal(got, silu_and_mul(plain))
    exact = gemv_ref(
        x.float(),
        w.float() if scale is None else w,
        None if b is None else b.float(),
        weight_scale=scale,
        swiglu=True,
    )
    ulp = {torch.float32: 2.0**-20, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    torch.testing.assert_close(got.float(), exact.float(), atol=8 * ulp, rtol=4 * ulp)
    with pytest.raises(ValueError, match="even"):
        gemv(x, w[1:], weight_scale=None if scale is None else scale[1:], swiglu=True)


class _Unfused:
    """TritonOps with the `*_for` ops and `gate_up_silu` taken from TorchOps: every kernel
    launched on its own, the projection quantizing its own input."""

    def __new__(cls, pdl: bool = False):
        from splitserve.engine.ops import TorchOps, TritonOps

        ops = TritonOps(pdl)
        for name in ("rms_norm_for", "add_rms_norm_for", "gate_up_silu"):
            setattr(ops, name, getattr(TorchOps, name).__get__(ops))
        return ops


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_the_fp8_mlp_and_norms_give_what_unfused_kernels_give(rows, static, device):
    """An FP8 decoder's MLP (merged gate/up) and its norms through `TritonOps`: the rows each
    kernel quantizes for the next projection, and the SwiGLU GEMV at one row, change nothing
    against the unfused launches; and the TorchOps reference agrees within FP8 rounding."""
    from splitserve.engine.model import MLP, RMSNorm
    from splitserve.engine.ops import TorchOps, TritonOps

    torch.manual_seed(rows)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96)
    fused, unfused, torch_ops = TritonOps(pdl=False), _Unfused(), TorchOps()
    mlp = MLP(cfg, fused).to(device, dtype)  # type: ignore[arg-type]
    for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        w8, w_scale = quantize_weight(proj.weight.detach())
        proj.weight = torch.nn.Parameter(w8, requires_grad=False)
        proj.register_buffer("weight_scale", w_scale.to(device))
        if static:
            proj.register_buffer("input_scale", torch.tensor([0.01], device=device))
    mlp.merge_projections()
    norm = RMSNorm(64, 1e-6, fused).to(device, dtype)
    x, residual = (torch.randn(rows, 64).to(device, dtype) for _ in range(2))

    results = {}
    for name, ops in (("fused", fused), ("unfused", unfused), ("torch", torch_ops)):
        mlp.ops = norm.ops = ops
        with torch.no_grad():
            h, new_residual = norm.norm_for(x, residual, mlp.gate_up_scales)
            first, _ = norm.norm_for(x, None, mlp.gate_up_scales)
            results[name] = (mlp(h), new_residual, mlp(first))
    for got, want in zip(results["fused"], results["unfused"], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(results["fused"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.05 * float(want.abs().max()))
