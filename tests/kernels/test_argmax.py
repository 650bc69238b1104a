"""argmax_rows equals torch.argmax, ties included, across chunk boundaries."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.argmax import argmax_rows, argmax_rows_ref
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(rows * 7919 + vocab)
    # Few distinct values: many ties, often in different chunks of a row.
    x = torch.randint(-3, 4, (rows, vocab), generator=gen).to(device, dtype)
    out = torch.full((rows,), -7, dtype=torch.int64, device=device)
    got = argmax_rows(x, out=out)
    assert got is out
    assert torch.equal(got, argmax_rows_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (1, 5000), (3, 4096), (2, 9000)])
def test_argmax_rows_matches_torch(rows, vocab, dtype, device):
    _check(rows, vocab, dtype, device)


def test_argmax_rows_picks_the_first_of_tied_maxima(device):
    x = torch.zeros(2, 10000, device=device)
    x[0, [9000, 50, 4100]] = 1.0
    x[1, [8191, 8192]] = 2.0
    assert argmax_rows(x).tolist() == [50, 8191]


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 128256), (8, 151936), (256, 32000)])
def test_argmax_rows_real_shapes_on_gpu(rows, vocab, dtype):
    _check(rows, vocab, dtype, torch.device("cuda"))
