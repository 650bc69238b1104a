"""The skinny FP8 GEMM (batch 2-64 decode) matches the dequantized product in float32, split
along K or not."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.quantization import quantize_weight
from splitserve.kernels.fp8_ref import quantize_rows_ref
from splitserve.kernels.fp8_skinny import (
    MAX_ROWS,
    pick_config,
    skinny_fp8_gemm,
    skinny_fp8_gemm_ref,
)
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _operands(m, n, k, device, bias_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed + m * 1009 + n * 31 + k)
    xq, xs = quantize_rows_ref(torch.randn(m, k, generator=gen))
    w8, scale = quantize_weight(torch.randn(n, k, generator=gen) / k**0.5)
    b = torch.randn(n, generator=gen).to(bias_dtype) if bias_dtype else None
    return [t if t is None else t.to(device) for t in (xq, xs, w8, scale, b)]


def _check(m, n, k, dtype, device, *, bias=False, config=None):
    xq, xs, w8, scale, b = _operands(m, n, k, device, dtype if bias else None)
    got = skinny_fp8_gemm(xq, xs, w8, scale, b, out_dtype=dtype, config=config)
    # The same product in float32, summed in another order; the kernel rounds once at the end.
    exact = skinny_fp8_gemm_ref(xq, xs, w8, scale, b, out_dtype=torch.float32)
    if dtype == torch.float32:
        # On a GPU the FP8 tensor cores sum up to ACC_SPAN products in fewer bits than float32
        # before each float32 add (on an H100: at most 1.2-1.7e-4 of the largest |output| on
        # the Llama-3-8B projections); the CPU is exact.
        tol = 2e-5 if device.type == "cpu" else 2.0**-10
        torch.testing.assert_close(got, exact, atol=tol, rtol=tol)
    else:
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(got.float(), exact, atol=4 * ulp, rtol=2 * ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(2, 40, 96), (5, 33, 700), (16, 16, 16), (3, 1, 40)])
def test_skinny_fp8_gemm_matches_the_dequantized_product(m, n, k, dtype, device):
    _check(m, n, k, dtype, device)


@pytest.mark.parametrize(("m", "n", "k"), [(4, 24, 80), (7, 9, 1100)])
def test_skinny_fp8_gemm_bias(m, n, k, device):
    _check(m, n, k, torch.float32, device, bias=True)
    _check(m, n, k, torch.float16, device, bias=True)


@pytest.mark.parametrize(
    "config",
    [
        (16, 16, 32, 1, 1, 2),  # rows over two programs, K whole in one
        (32, 32, 32, 3, 2, 3),  # K over three programs of whole tiles
        (16, 64, 32, 4, 4, 1),  # ragged channels, K over four programs, the last one short
        (16, 16, 32, 5, 1, 1),  # more splits than K has tiles: some programs sum nothing
    ],
)
def test_skinny_fp8_gemm_split_along_k(config, device):
    _check(19, 50, 96, torch.float32, device, config=config)
    _check(19, 50, 100, torch.float16, device, config=config, bias=True)


def test_the_split_counters_are_reset_for_the_next_call(device):
    """A split launch leaves its per-tile counters at zero, so the next launch (another shape,
    the same workspace) sums its own parts and no one else's."""
    from splitserve.kernels.fp8_skinny import _WORKSPACES

    config = (16, 16, 32, 3, 1, 1)
    for m, n in ((3, 40), (20, 24), (3, 40)):
        _check(m, n, 96, torch.float32, device, config=config)
    (held,) = [held for where, held in _WORKSPACES.items() if where.type == device.type]
    assert all(int(counts.abs().sum()) == 0 for _, counts in held)


def test_every_row_count_gets_one_row_tile_and_enough_programs():
    for m in range(1, MAX_ROWS + 1):
        block_m, block_n, block_k, split, _, _ = pick_config(m, 4096, 4096)
        assert block_m >= m and block_m >= 16
        assert 4096 // block_n * split >= 256  # a short projection still fills an H100
        assert 4096 // block_k >= 2 * split  # and each program sums two K tiles or more
    assert pick_config(8, 28672, 4096)[3] == 1  # a wide one needs no split


def test_skinny_fp8_gemm_rejects_bad_inputs(device):
    xq, xs, w8, scale, _ = _operands(2, 4, 8, device)
    with pytest.raises(ValueError, match="columns"):
        skinny_fp8_gemm(xq[:, :6], xs, w8, scale)
    with pytest.raises(ValueError, match="xq must have dtype"):
        skinny_fp8_gemm(xq.float(), xs, w8, scale)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        skinny_fp8_gemm(xq, xs, w8, scale[:3])
    with pytest.raises(ValueError, match="x_scale must have shape"):
        skinny_fp8_gemm(xq, xs[:1], w8, scale)
    with pytest.raises(ValueError, match="bias must have dtype"):
        skinny_fp8_gemm(xq, xs, w8, scale, torch.zeros(4, device=device, dtype=torch.float16))


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("m", [2, 8, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_skinny_fp8_gemm_real_shapes_on_gpu(m, n, k, dtype):
    _check(m, n, k, dtype, torch.device("cuda"))


@needs_gpu
@pytest.mark.parametrize("m", [2, 8, MAX_ROWS, MAX_ROWS + 1])
def test_the_engine_linear_matches_the_fp8_reference_on_both_sides_of_max_rows(m):
    """`TritonOps.linear` on an FP8 weight (skinny kernel up to MAX_ROWS rows, `_scaled_mm`
    above) computes the reference's arithmetic: per-token FP8 activations, float32 sums."""
    from splitserve.engine.ops import TritonOps
    from splitserve.engine.quantization import fp8_linear_ref

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
    w8, scale = quantize_weight(torch.randn(6144, 4096, generator=gen) / 64)
    w8, scale = w8.cuda(), scale.cuda()
    got = TritonOps(pdl=True).linear(x, w8, weight_scale=scale)
    want = fp8_linear_ref(x, w8, scale, None, None).float()
    torch.testing.assert_close(got.float(), want, atol=4 * 2.0**-7, rtol=2 * 2.0**-7)
