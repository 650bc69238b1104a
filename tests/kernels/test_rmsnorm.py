"""RMSNorm and fused add + RMSNorm match engine/model.py's numerics, in place or not."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model import RMSNorm
from splitserve.engine.ops import TorchOps
from splitserve.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = [(1, 16), (7, 64), (5, 100), (2, 3, 48)]  # 100: not a power of two; 3-D input


def _inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen)).to(device, dtype)
    residual = torch.randn(shape, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    return x, residual, weight


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # One rounding of the output apart at most (the mean is summed in another order).
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.01}


def _check(shape, dtype, device, seed):
    x, residual, weight = _inputs(shape, dtype, device, seed)
    out = torch.full_like(x, float("nan"))
    got = rms_norm(x, weight, 1e-6, out=out)
    assert got is out
    torch.testing.assert_close(got, rms_norm_ref(x, weight, 1e-6), **_tol(dtype))

    normed_out, residual_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6, normed_out, residual_out)
    assert normed is normed_out and new_residual is residual_out
    want_normed, want_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, want_normed, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype, device):
    _check(shape, dtype, device, seed=len(shape) * 100 + shape[-1])


def test_reference_is_the_model_rmsnorm():
    # The model's torch ops are the reference (Triton ops call the kernel under test).
    x, _, weight = _inputs((4, 32), torch.float32, torch.device("cpu"), seed=1)
    module = RMSNorm(32, 1e-5, TorchOps())
    module.weight.data.copy_(weight)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-5), module(x), rtol=0, atol=0)


def test_fused_add_updates_the_residual_in_place(device):
    x, residual, weight = _inputs((6, 64), torch.float32, device, seed=2)
    want_normed, want_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6, residual_out=residual)
    assert new_residual is residual
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, want_normed, **_tol(torch.float32))


def test_float32_weight_promotes_a_half_input_like_torch(device):
    x, _, weight = _inputs((3, 32), torch.float16, device, seed=3)
    got = rms_norm(x, weight.float(), 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_ref(x, weight.float(), 1e-6), atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise_before_launch(device):
    x, residual, weight = _inputs((3, 32), torch.float32, device, seed=4)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, weight[:16], 1e-6)
    with pytest.raises(ValueError, match="residual must have dtype"):
        fused_add_rms_norm(x, residual.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(x.t().contiguous().t(), weight, 1e-6)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(4096, 4096), (3, 5120), (17, 8192)])
def test_rms_norm_real_shapes_on_gpu(dtype, shape):
    _check(shape, dtype, torch.device("cuda"), seed=shape[0])
