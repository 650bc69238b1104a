"""`rope_query` turns the decode query's RoPE part as engine/mla.py's torch `rotate` does, in
each of the three layouts, from a strided slice of the projected query into a strided slice of
the absorbed query, and touches nothing else there."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.mla import rotate
from splitserve.engine.model_config import RopeConfig
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.kernels.latent_write import LAYOUTS
from splitserve.kernels.mla_query import rope_query
from tests.kernels.paged_inputs import DTYPES


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("heads", "nope", "rope", "rank"), [(16, 128, 64, 512), (5, 16, 8, 32)])
@pytest.mark.parametrize("dtype", DTYPES)  # bfloat16 on a GPU only: the interpreter gets it wrong
def test_rope_query_matches_rotate_between_strided_views(
    device, layout, heads, nope, rope, rank, dtype
):
    gen = torch.Generator().manual_seed(heads + rope + len(layout))
    num_tokens = 7
    rotary = RotaryEmbedding(
        RopeConfig(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, mscale=0.7),
        rope,
        128,
    )
    rotary.reset(device)
    # The projected query [T, heads, nope + rope]: q_pe is its strided tail.
    q = (3 * torch.randn(num_tokens, heads, nope + rope, generator=gen)).to(device, dtype)
    q_pe = q[..., nope:]
    positions = torch.randint(0, 128, (num_tokens,), generator=gen).to(device)
    # The absorbed query, stored head-major [heads, T, rank + rope] and seen as [T, heads, *].
    buf = torch.full((heads, num_tokens, rank + rope), 7.0, dtype=dtype, device=device)
    out = buf.transpose(0, 1)[..., rank:]
    assert rope_query(q_pe, positions, rotary.cos, rotary.sin, layout, out) is out
    want = rotate(positions, q_pe, None, rotary, layout)[0]
    # float32: torch's complex product may fuse differently; bfloat16: one rounding apart.
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, atol=atol, rtol=atol)
    assert torch.all(buf[..., :rank] == 7.0)


def test_rope_query_refuses_what_it_cannot_turn(device):
    rotary = RotaryEmbedding(RopeConfig(), 8, 32)
    rotary.reset(device)
    q = torch.zeros(2, 4, 8, device=device)
    positions = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="layout"):
        rope_query(q, positions, rotary.cos, rotary.sin, "spiral", q.clone())
    with pytest.raises(ValueError, match="out"):
        rope_query(q, positions, rotary.cos, rotary.sin, "half", q[:, :, :4].clone())
    with pytest.raises(ValueError, match="cos"):
        rope_query(q, positions, rotary.cos[:, :4], rotary.sin, "half", q.clone())
