"""Rotary embedding matches engine/rotary.py (default and Llama-3 scaled tables), in place and
out of place, for q and k with different head counts."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model_config import RopeConfig
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.kernels.rotary import rotary_embedding, rotary_embedding_ref
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LLAMA3 = RopeConfig(
    theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=256
)


def _check(num_tokens, num_heads, num_kv_heads, head_dim, rope, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(rope, head_dim, max_len=1024)
    rotary.reset(device)
    positions = torch.randint(0, 1024, (num_tokens,), generator=gen).to(device)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    want_q, want_k = rotary(positions, q, k)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, rotary.cos, rotary.sin)
    torch.testing.assert_close(ref_q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(ref_k, want_k, rtol=0, atol=0)

    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    got_q, got_k = rotary_embedding(
        positions, q, k, rotary.cos, rotary.sin, q_out=q_out, k_out=k_out
    )
    assert got_q is q_out and got_k is k_out
    # float32 may differ by an FMA on a GPU. 16-bit results round at the same places as torch
    # under the interpreter, but a GPU contracts multiply-adds: one 16-bit ulp apart there.
    if dtype == torch.float32:
        tol = {"atol": 1e-5, "rtol": 1e-5}
    elif device.type == "cuda":
        # q*cos + rot(q)*sin can cancel: one ulp of the operands (|q| < ~4), not of the result.
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        tol = {"atol": 4 * ulp, "rtol": ulp}
    else:
        tol = {"atol": 0, "rtol": 0}
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)

    same_q, same_k = rotary_embedding(positions, q, k, rotary.cos, rotary.sin, inplace=True)
    assert same_q is q and same_k is k
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "rope"),
    [(1, 1, 1, 16, RopeConfig()), (9, 4, 2, 16, LLAMA3), (5, 6, 3, 64, RopeConfig(theta=1e6))],
)
def test_rotary_matches_the_engine(
    num_tokens, num_heads, num_kv_heads, head_dim, rope, dtype, device
):
    _check(num_tokens, num_heads, num_kv_heads, head_dim, rope, dtype, device, seed=head_dim)


def test_each_half_uses_its_own_table_columns(device):
    # The engine's tables repeat their halves; random ones catch a kernel that mixes them up.
    gen = torch.Generator().manual_seed(5)
    cos, sin = torch.randn(2, 50, 32, generator=gen).to(device)
    positions = torch.randint(0, 50, (6,), generator=gen).to(device)
    q = torch.randn(6, 4, 32, generator=gen).to(device)
    k = torch.randn(6, 1, 32, generator=gen).to(device)
    got = rotary_embedding(positions, q, k, cos, sin)
    want = rotary_embedding_ref(positions, q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise_before_launch(device):
    rotary = RotaryEmbedding(RopeConfig(), 16, max_len=8)
    q, k = torch.randn(2, 4, 16, device=device), torch.randn(2, 2, 16, device=device)
    positions = torch.arange(2, device=device)
    cos, sin = rotary.cos.to(device), rotary.sin.to(device)
    with pytest.raises(ValueError, match="positions must have dtype"):
        rotary_embedding(positions.int(), q, k, cos, sin)
    with pytest.raises(ValueError, match="k must have shape"):
        rotary_embedding(positions, q, k[..., :8], cos, sin)
    with pytest.raises(ValueError, match="either inplace"):
        rotary_embedding(positions, q, k, cos, sin, inplace=True, q_out=q)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rotary_real_shapes_on_gpu(dtype):
    _check(4096, 32, 8, 128, LLAMA3, dtype, torch.device("cuda"), seed=0)
