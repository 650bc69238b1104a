"""Rotary position embedding (RoPE), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from splitserve.engine.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies, float32, computed the way HF transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin tables for every position up to `max_len` and rotates q and k in place."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_len = rope, head_dim, max_len
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.reset(torch.empty(0).device)  # the default device: meta while a model is built

    def reset(self, device: torch.device | str) -> None:
        """(Re)compute the float32 tables on `device`; models built on the meta device call this
        once they are materialised, since the tables are not part of the checkpoint."""
        # Computed on the CPU whatever the default device, then moved.
        inv_freq = inverse_frequencies(self.rope, self.head_dim)
        positions = torch.arange(self.max_len, dtype=torch.float32, device="cpu")
        emb = torch.outer(positions, inv_freq)
        emb = torch.cat((emb, emb), dim=-1).to(device)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim], positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
