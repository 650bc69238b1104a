"""silu_and_mul matches silu(gate) * up, including rows wider than one program's block."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(num_tokens: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7 + intermediate)
    x = (4 * torch.randn(num_tokens, 2 * intermediate, generator=gen)).to(device, dtype)
    out = torch.full((num_tokens, intermediate), float("nan"), dtype=dtype, device=device)
    got = silu_and_mul(x, out=out)
    assert got is out
    if dtype == torch.float32:
        torch.testing.assert_close(got, silu_and_mul_ref(x), atol=1e-6, rtol=1e-5)
    else:
        # Compare with the exact float32 product: the kernel and torch's 16-bit reference each
        # round (once or twice) on the way, so allow one 16-bit ulp.
        exact = silu_and_mul_ref(x.float())
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(got.float(), exact, rtol=ulp, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "intermediate"), [(1, 16), (5, 100), (3, 2500)])
def test_silu_and_mul_matches_reference(num_tokens, intermediate, dtype, device):
    _check(num_tokens, intermediate, dtype, device)


def test_odd_width_is_rejected(device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7, device=device))


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_silu_and_mul_real_shapes_on_gpu(dtype):
    _check(4096, 14336, dtype, torch.device("cuda"))
