"""The MLA latent write stores each token's latent row at its slot of one layer of the
block-major latent pool, skips negative slots, touches no other layer or slot, and refuses
what it cannot write."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.latent_write import write_latents, write_latents_ref

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
