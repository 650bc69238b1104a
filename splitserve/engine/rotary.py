"""Rotary position embedding (RoPE), with Llama-3 and YaRN frequency scaling.

Every step follows transformers' `modeling_rope_utils` operation for operation (float32 tensors,
Python floats for the scalars), so the cos/sin tables equal HF's bit for bit. YaRN's attention
factor scales the tables themselves, as HF scales its cos/sin, so the Triton rotary kernels,
which read these tables, need nothing of their own.
"""

from __future__ import annotations

import math

import torch

from splitserve.engine.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies, float32, computed the way HF transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    pos_freqs = rope.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim, pos_freqs)
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


def _yarn_inverse_frequencies(
    rope: RopeConfig, head_dim: int, pos_freqs: torch.Tensor
) -> torch.Tensor:
    """YaRN: dimensions that turn many times over the original context keep their frequency
    (extrapolation), slow ones are divided by `factor` (interpolation), a linear ramp between."""
    base, dim = rope.theta, head_dim
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times in the original context.
        original = rope.original_max_position_embeddings
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (as HF: no division by zero)
    # NOTE: on the CPU, as the rest: the default device is meta while a model is built.
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((pairs - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    # NOTE: 1 / (factor * base**e), not (1 / base**e) / factor: HF's rounding.
    interpolation = 1.0 / (rope.factor * pos_freqs)
    return interpolation * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_scaling(rope: RopeConfig) -> float:
    """The factor on the cos/sin tables: YaRN's `attention_factor` (given, or from `factor`
    and `mscale` / `mscale_all_dim` as transformers derives it); 1 otherwise."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return float(
            _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
        )
    return _yarn_mscale(rope.factor)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    """YaRN paper, Eq. 21: 0.1 * mscale * ln(scale) + 1 (1 without scaling)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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
        cos, sin = emb.cos(), emb.sin()
        scaling = attention_scaling(self.rope)
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim], positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate_one(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`forward` for one tensor x: [T, heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
