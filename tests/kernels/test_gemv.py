"""gemv matches F.linear for a single row, ragged N and K, with and without bias."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.gemv import gemv, gemv_ref
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    bias: bool = False,
    config: tuple[int, int, int] | None = None,
) -> None:
    gen = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(1, k, generator=gen).to(device, dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    out = torch.full((1, n), float("nan"), dtype=dtype, device=device)
    got = gemv(x, weight, b, out=out, config=config)
    assert got is out
    # The float32 product of the same inputs; the kernel accumulates in float32 in another order
    # and rounds once at the end.
    exact = gemv_ref(x.float(), weight.float(), None if b is None else b.float())
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, atol=2e-5, rtol=2e-5)
    else:
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(got.float(), exact, atol=4 * ulp, rtol=2 * ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(40, 96), (33, 700), (16, 16), (1, 5)])
def test_gemv_matches_linear(n, k, dtype, device):
    _check(n, k, dtype, device)


@pytest.mark.parametrize(("n", "k"), [(24, 80), (9, 1100)])
def test_gemv_bias(n, k, device):
    _check(n, k, torch.float32, device, bias=True)
    _check(n, k, torch.float16, device, bias=True)


@pytest.mark.parametrize("config", [(8, 32, 1), (32, 64, 2), (16, 1024, 8)])
def test_gemv_explicit_tiles(config, device):
    _check(50, 100, torch.float32, device, config=config)


def test_gemv_rejects_bad_shapes(device):
    x = torch.randn(1, 8, device=device)
    with pytest.raises(ValueError, match="columns"):
        gemv(x, torch.randn(4, 6, device=device))
    with pytest.raises(ValueError, match="1 row"):
        gemv(torch.randn(2, 8, device=device), torch.randn(4, 8, device=device))
    with pytest.raises(ValueError, match="dtype"):
        gemv(x, torch.randn(4, 8, device=device, dtype=torch.float16))


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
)
def test_gemv_real_shapes_on_gpu(n, k, dtype):
    _check(n, k, dtype, torch.device("cuda"))


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 96, False), (33, 700, True), (1, 5, False)])
def test_fp8_gemv_matches_the_dequantized_product(n, k, bias, dtype, device):
    """An FP8 (e4m3) weight with one float32 scale per output channel: the product of the
    dequantized weight, in float32, scaled and biased, rounded once."""
    from splitserve.engine.quantization import quantize_weight

    gen = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(1, k, generator=gen).to(device, dtype)
    w8, scale = quantize_weight(torch.randn(n, k, generator=gen) / k**0.5)
    w8, scale = w8.to(device), scale.to(device)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    got = gemv(x, w8, b, weight_scale=scale)
    exact = gemv_ref(x, w8, b, weight_scale=scale).float()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(got.float(), exact, atol=4 * ulp, rtol=2 * ulp)
    with pytest.raises(ValueError, match="weight"):
        gemv(x, w8.to(dtype), b, weight_scale=scale)  # a scale belongs to an FP8 weight
