"""The KV-cache write stores each token at its slot of one layer of the block-major pool, skips
negative slots, touches nothing else (no other layer), and accepts strided k and v."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from tests.kernels.paged_inputs import GPU_DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    strided: bool = False,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, num_kv_heads, head_dim)
    if strided:
        # k and v as views into one fused qkv-like buffer: token stride != heads * dim.
        fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen)
        fused = fused.to(device, dtype)
        k, v = fused[:, 1], fused[:, 2]
    else:
        k = torch.randn(shape, generator=gen).to(device, dtype)
        v = torch.randn(shape, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding tokens
    slots = slots.to(device)
    # The middle layer of a block-major pool (the engine's layout): pages are strided.
    pool_shape = (num_blocks, 3, 2, block_size, num_kv_heads, head_dim)
    pool = torch.full(pool_shape, float("nan"), dtype=dtype, device=device)
    want_pool = pool.clone()
    write_kv_cache(k, v, pool[:, 1].transpose(0, 1), slots)
    write_kv_cache_ref(k, v, want_pool[:, 1].transpose(0, 1), slots)
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=0, equal_nan=True)
    written = int((slots >= 0).sum())
    assert int((~pool.isnan()).sum()) == 2 * written * num_kv_heads * head_dim  # one layer only


@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "num_blocks", "block_size", "strided"),
    [
        (1, 1, 16, 1, 16, False),
        (37, 2, 16, 5, 16, False),
        (50, 3, 32, 20, 4, False),  # heads not a power of two
        (20, 4, 64, 3, 8, True),
    ],
)
def test_write_matches_reference(
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size, strided, device
):
    _check(
        num_tokens,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        torch.float32,
        device,
        seed=num_tokens,
        strided=strided,
    )


def test_slots_past_the_pool_are_not_written(device):
    k = torch.randn(3, 2, 16, device=device)
    cache = torch.zeros(2, 2, 4, 2, 16, device=device)
    write_kv_cache(k, k, cache, torch.tensor([0, 8, 1000], device=device))
    assert torch.equal(cache[0, 0, 0], k[0]) and torch.count_nonzero(cache) == 2 * 2 * 16


def test_empty_batch_is_a_no_op(device):
    cache = torch.zeros(2, 2, 4, 2, 16, device=device)
    empty = torch.empty(0, 2, 16, device=device)
    write_kv_cache(empty, empty, cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.count_nonzero(cache) == 0


def test_bad_arguments_raise_before_launch(device):
    k = torch.randn(3, 2, 16, device=device)
    cache = torch.zeros(2, 2, 4, 2, 16, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        write_kv_cache(k, k, cache, slots.int())
    with pytest.raises(ValueError, match="k must have dtype"):
        write_kv_cache(k.double(), k, cache, slots)
    with pytest.raises(ValueError, match="v must have shape"):
        write_kv_cache(k, k[:, :1], cache, slots)
    with pytest.raises(ValueError, match="kv_cache must hold each block densely"):
        write_kv_cache(k, k, cache.transpose(2, 3), slots)
    with pytest.raises(ValueError, match="unit stride"):
        write_kv_cache(k, k.transpose(0, 2).contiguous().transpose(0, 2), cache, slots)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_write_real_shapes_on_gpu(dtype):
    _check(4096, 8, 128, 512, 16, dtype, torch.device("cuda"), seed=0, strided=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_fp8_cache_stores_saturated_nearest_even_values(dtype, device):
    """Into an FP8 (e4m3, scale 1) cache: each value rounded to nearest even, those beyond
    +-448 saturated (a plain cast would store NaN); the same bits as the reference."""
    gen = torch.Generator().manual_seed(7)
    num_tokens, heads, dim, num_blocks, block_size = 29, 2, 16, 4, 8
    scale = torch.logspace(-4, 3, num_tokens)[:, None, None]  # 1e-4 (subnormal) to 1000
    k = (torch.randn(num_tokens, heads, dim, generator=gen) * scale).to(device, dtype)
    v = (torch.randn(num_tokens, heads, dim, generator=gen) * scale).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    pool_shape = (num_blocks, 3, 2, block_size, heads, dim)
    pool = torch.full(pool_shape, float("nan"), dtype=torch.float8_e4m3fn, device=device)
    want = pool.clone()
    write_kv_cache(k, v, pool[:, 1].transpose(0, 1), slots)
    write_kv_cache_ref(k, v, want[:, 1].transpose(0, 1), slots)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))
    written = pool[:, 1].float()
    assert written.nan_to_num(0).abs().max() == 448.0  # saturated, not NaN
    assert int((~written.isnan()).sum()) == 2 * num_tokens * heads * dim
