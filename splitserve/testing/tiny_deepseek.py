"""Tiny random-weight DeepSeek-V2 / -V3 checkpoints (MLA, DeepSeek MoE, a multi-token-prediction
layer), written by transformers: the HF oracle of engine/mla.py and engine/deepseek_moe.py."""

from __future__ import annotations

import os
import pathlib

import torch
from safetensors.torch import save_file

from splitserve.testing.tiny_hf import write_hf_checkpoint
from splitserve.testing.tiny_model import (
    BIAS_STD,
    EMBED_STD,
    LM_HEAD_GAIN,
    NORM_WEIGHT_STD,
    RESIDUAL_GAIN,
)

TINY_DEEPSEEK = ("deepseek_v2", "deepseek_v3")

_DEEPSEEK_BASE: dict = {
    "hidden_size": 64,
    "intermediate_size": 96,  # the dense layers'
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,  # != qk_nope_head_dim, as a shape check
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "dtype": "float32",
}

_DEEPSEEK_CONFIGS: dict[str, dict] = {
    # DeepSeek-V2-Lite's shape of features: no query compression, YaRN, softmax routing limited
    # to the best groups (by their best expert), two shared experts.
    "deepseek_v2": {
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "n_shared_experts": 2,
        # More experts than the kept groups' best: the group limit changes the choice.
        "num_experts_per_tok": 3,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": False,
        "max_position_embeddings": 2560,  # 40 x the original context: YaRN's factor
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
    # DeepSeek-V3's: compressed queries, sigmoid scores with a selection-only bias, groups ranked
    # by the sum of their two best experts, interleaved RoPE, a YaRN whose mscales differ.
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "q_lora_rank": 48,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    },
}


def make_tiny_deepseek_model(
    out_dir: str | os.PathLike,
    variant: str = "deepseek_v3",
    *,
    seed: int = 0,
    config_overrides: dict | None = None,
    mtp_layer: bool = True,
) -> pathlib.Path:
    """Write a tiny random-weight DeepSeek-V2 or -V3 checkpoint (`variant`, one of
    TINY_DEEPSEEK) with its tokenizer into out_dir; return the path. With `mtp_layer`, the
    safetensors also hold a multi-token-prediction layer after the last decoder layer, as
    DeepSeek-V3's checkpoints do (transformers ignores it; so must the engine)."""
    if variant not in _DEEPSEEK_CONFIGS:
        raise ValueError(f"unknown DeepSeek variant {variant!r}; supported: {TINY_DEEPSEEK}")
    config = {**_DEEPSEEK_BASE, **_DEEPSEEK_CONFIGS[variant], **(config_overrides or {})}
    out, raw, gen = write_hf_checkpoint(out_dir, config, _deepseek_draw, seed, _draw_bias)
    if mtp_layer:
        _add_mtp_layer(out, raw, gen)
    return out


def _draw_bias(name: str, buffer: torch.Tensor, gen: torch.Generator) -> None:
    """V3's selection bias is a buffer in transformers: drawn like a bias."""
    if name.endswith("e_score_correction_bias"):
        buffer.copy_(BIAS_STD * torch.randn(buffer.shape, generator=gen))


def _deepseek_draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + NORM_WEIGHT_STD * noise
    if name.endswith("bias"):
        return BIAS_STD * noise
    if name.endswith("embed_tokens.weight"):
        return EMBED_STD * noise
    if name == "lm_head.weight":
        return noise * (LM_HEAD_GAIN / shape[1] ** 0.5)
    # Stacked experts are W @ x ([E, out, in]) like every Linear: the fan-in is the last dim.
    if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
        return noise * (RESIDUAL_GAIN / shape[-1] ** 0.5)
    return noise / shape[-1] ** 0.5


def _add_mtp_layer(out: pathlib.Path, raw: dict, gen: torch.Generator) -> None:
    """A few tensors of a multi-token-prediction layer (index num_hidden_layers) added to the
    saved safetensors, named as DeepSeek-V3 names them."""
    from safetensors.torch import load_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    hidden, layer = raw["hidden_size"], f"model.layers.{raw['num_hidden_layers']}."
    tensors[f"{layer}enorm.weight"] = torch.ones(hidden)
    tensors[f"{layer}hnorm.weight"] = torch.ones(hidden)
    tensors[f"{layer}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)
    tensors[f"{layer}input_layernorm.weight"] = torch.ones(hidden)
    save_file(tensors, str(path), metadata={"format": "pt"})
