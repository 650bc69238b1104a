"""rotary_embedding_write_kv equals rotary_embedding then write_kv_cache: q rotated, the rotated
k and the plain v at each token's slot, padding slots (-1) and every other slot untouched."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model_config import RopeConfig
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.kernels.rotary import rotary_embedding_write_kv, rotary_embedding_write_kv_ref
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(
    num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, num_blocks=6, block=4,
    kv_dtype=None,
):
    gen = torch.Generator().manual_seed(num_tokens * 131 + num_heads * 7 + head_dim)
    rotary = RotaryEmbedding(RopeConfig(theta=1e4), head_dim, max_len=512)
    rotary.reset(device)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(device)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding rows: no KV write
    slots = slots.to(device)
    # The last layer of a two-layer block-major pool (the engine's layout): pages are strided.
    pool = torch.randn(num_blocks, 2, 2, block, num_kv_heads, head_dim, generator=gen)
    pool = pool.to(device, kv_dtype or dtype)
    want_pool = pool.clone()
    cache, want_cache = pool[:, 1].transpose(0, 1), want_pool[:, 1].transpose(0, 1)
    k_before = k.clone()
    want_q = rotary_embedding_write_kv_ref(
        positions, q, k, v, rotary.cos, rotary.sin, want_cache, slots
    )
    q_out = torch.full_like(q, float("nan"))
    got_q = rotary_embedding_write_kv(
        positions, q, k, v, rotary.cos, rotary.sin, cache, slots, q_out=q_out
    )
    assert got_q is q_out
    if dtype == torch.float32:
        tol = {"atol": 1e-5, "rtol": 1e-5}
    elif device.type == "cuda":  # a GPU contracts multiply-adds: one operand ulp apart
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        tol = {"atol": 4 * ulp, "rtol": ulp}
    else:
        tol = {"atol": 0, "rtol": 0}
    torch.testing.assert_close(got_q, want_q, **tol)
    if kv_dtype == torch.float8_e4m3fn and device.type == "cuda":
        # A rotated key as far apart as q's tolerance allows (contracted multiply-adds) may
        # round to the next e4m3 value: one e4m3 step more, relative or (subnormal) absolute.
        tol = {"atol": tol["atol"] + 2.0**-9, "rtol": 2.0**-3}
    torch.testing.assert_close(pool.float(), want_pool.float(), **tol)
    assert torch.equal(cache[1].float(), want_cache[1].float()), "v is copied (or quantized)"
    assert torch.equal(pool[:, 0].float(), want_pool[:, 0].float()), "the other layer is untouched"
    assert torch.equal(k, k_before), "k itself is not modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
    [(1, 1, 1, 16), (7, 4, 2, 16), (5, 6, 3, 64)],
)
def test_rotary_write_kv_matches_the_two_references(
    num_tokens, num_heads, num_kv_heads, head_dim, dtype, device
):
    _check(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "num_heads", "num_kv_heads", "head_dim"), [(7, 4, 2, 16)])
def test_rotary_write_kv_into_an_fp8_cache_quantizes_as_the_references(
    num_tokens, num_heads, num_kv_heads, head_dim, dtype, device
):
    # The keys round to q's dtype, then saturate to +-448 and round to nearest even, as
    # rotary_embedding then write_kv_cache do; v is quantized the same way.
    _check(
        num_tokens, num_heads, num_kv_heads, head_dim, dtype, device,
        kv_dtype=torch.float8_e4m3fn,
    )


def test_rotary_write_kv_rejects_a_cache_of_the_wrong_shape(device):
    q, k = torch.randn(2, 4, 16, device=device), torch.randn(2, 2, 16, device=device)
    rotary = RotaryEmbedding(RopeConfig(), 16, max_len=8)
    rotary.reset(device)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    cache = torch.zeros(2, 3, 4, 1, 16, device=device)
    with pytest.raises(ValueError, match="does not fit"):
        rotary_embedding_write_kv(positions, q, k, k, rotary.cos, rotary.sin, cache, slots)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rotary_write_kv_real_shapes_on_gpu(dtype):
    _check(300, 32, 8, 128, dtype, torch.device("cuda"), num_blocks=64, block=16)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_write_kv_into_an_fp8_cache_real_shapes_on_gpu(dtype):
    _check(
        300, 32, 8, 128, dtype, torch.device("cuda"), num_blocks=64, block=16,
        kv_dtype=torch.float8_e4m3fn,
    )
