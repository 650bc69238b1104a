"""The MLA latent writes store each token's latent row at its slot of one layer of the
block-major latent pool, skip negative slots, touch no other layer or slot, and refuse what they
cannot write; the fused one normalises and turns the row as the layer's torch path does."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.mla import rotate
from splitserve.engine.model_config import RopeConfig
from splitserve.engine.ops import TorchOps
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.kernels.latent_write import (
    LAYOUTS,
    write_latents,
    write_latents_normed,
    write_latents_ref,
)
from tests.kernels.paged_inputs import DTYPES

# DeepSeek's row (512 + 64, not a power of two) and a small one.
ROWS = [(576, 16, 8), (40, 4, 16)]


@pytest.mark.parametrize(("latent_dim", "num_blocks", "block_size"), ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_write_matches_reference_in_a_strided_layer(
    device, latent_dim, num_blocks, block_size, dtype
):
    gen = torch.Generator().manual_seed(latent_dim)
    num_tokens = num_blocks * block_size // 2
    latents = torch.randn(num_tokens, latent_dim, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding rows of a replayed graph
    slots = slots.to(device)
    # The middle layer of a block-major pool [blocks, layers, 1 plane, block_size, 1, dim].
    pool = torch.randn(num_blocks, 3, 1, block_size, 1, latent_dim, generator=gen).to(device, dtype)
    want = pool.clone()
    write_latents(latents, pool[:, 1].transpose(0, 1), slots)
    write_latents_ref(latents, want[:, 1].transpose(0, 1), slots)
    assert torch.equal(pool, want)
    # Independently of the reference: the written rows, and nothing else moved.
    flat = pool[:, 1, 0, :, 0].reshape(-1, latent_dim)
    keep = slots >= 0
    assert torch.equal(flat[slots[keep]], latents[keep])
    assert keep.sum() < num_tokens  # the case has padding rows to skip


def test_latent_write_refuses_bad_layouts(device):
    cache = torch.zeros(1, 4, 8, 1, 40, device=device)
    slots = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match=r"\[1, num_blocks"):
        write_latents(torch.zeros(2, 40, device=device), torch.zeros(2, 4, 8, 1, 40), slots)
    with pytest.raises(ValueError, match="latents"):
        write_latents(torch.zeros(2, 40, device=device, dtype=torch.float16), cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_latents(torch.zeros(2, 40, device=device), cache, slots.int())
    # Nothing to write: no launch, nothing changed.
    write_latents(torch.zeros(0, 40, device=device), cache, slots[:0])
    assert not cache.any()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("rank", "rope"), [(512, 64), (32, 8)])
@pytest.mark.parametrize("dtype", DTYPES)  # bfloat16 on a GPU only: the interpreter gets it wrong
def test_normed_write_matches_the_layers_torch_path(device, layout, rank, rope, dtype):
    """One launch gives what engine/mla.py's torch path writes: the latent RMS-normed, the RoPE
    key turned at the token's position in the layout (YaRN-scaled tables), padding skipped."""
    gen = torch.Generator().manual_seed(rank + len(layout))
    num_blocks, block_size, num_tokens = 6, 16, 40
    rotary = RotaryEmbedding(
        RopeConfig(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, mscale=0.7),
        rope,
        128,
    )
    rotary.reset(device)
    kv_a = (3 * torch.randn(num_tokens, rank + rope, generator=gen)).to(device, dtype)
    weight = (1 + torch.randn(rank, generator=gen)).to(device, dtype)
    positions = torch.randint(0, 128, (num_tokens,), generator=gen).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1
    slots = slots.to(device)
    pool = torch.zeros(num_blocks, 2, 1, block_size, 1, rank + rope, device=device, dtype=dtype)
    want = pool.clone()
    write_latents_normed(
        kv_a, weight, 1e-6, positions, rotary.cos, rotary.sin, layout,
        pool[:, 1].transpose(0, 1), slots,
    )  # fmt: skip
    kv_c, k_pe = kv_a.split([rank, rope], dim=-1)
    normed = TorchOps().rms_norm(kv_c.contiguous(), weight, 1e-6)
    q_unused = torch.zeros(num_tokens, 1, rope, device=device, dtype=dtype)
    _, k_rot = rotate(positions, q_unused, k_pe[:, None], rotary, layout)
    assert k_rot is not None
    write_latents_ref(torch.cat([normed, k_rot[:, 0]], -1), want[:, 1].transpose(0, 1), slots)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(pool, want, atol=atol, rtol=atol)
    assert torch.equal(pool[:, 0], want[:, 0])  # the other layer untouched
    assert pool[:, 1].abs().sum() > 0


def test_normed_write_refuses_a_row_of_another_width(device):
    rotary = RotaryEmbedding(RopeConfig(), 8, 16)
    rotary.reset(device)
    cache = torch.zeros(1, 2, 16, 1, 40, device=device)
    args = (torch.zeros(3, 40, device=device), torch.ones(30, device=device), 1e-6)
    tail = (torch.zeros(3, dtype=torch.long, device=device), rotary.cos, rotary.sin)
    slots = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="rank 30"):
        write_latents_normed(*args, *tail, "complex", cache, slots)
    with pytest.raises(ValueError, match="layout"):
        write_latents_normed(*args, *tail, "spiral", cache, slots)
