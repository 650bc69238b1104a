"""Tiny random-weight checkpoints of the families whose layers transformers itself should shape:
Qwen3-MoE, Mixtral, gpt-oss and Gemma 3.

The model is built by transformers from its config class (so the checkpoint is exactly what
transformers saves: one tensor per expert for Qwen3-MoE and Mixtral, stacked experts for
gpt-oss), then its weights are redrawn with the peaky scales of `tiny_model` (clear greedy
margins) and saved with the locally trained tokenizer. Each family's config exercises what
sets it apart: dense layers among sparse ones, sliding windows short enough for tests to cross,
per-layer RoPE bases, a query scale that is not 1/sqrt(head_dim).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch

from splitserve.testing.tiny_hf import write_hf_checkpoint
from splitserve.testing.tiny_model import (
    BIAS_STD,
    EMBED_STD,
    LM_HEAD_GAIN,
    NORM_WEIGHT_STD,
    RESIDUAL_GAIN,
)

TINY_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "gemma3")

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "dtype": "float32",
}

_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "intermediate_size": 96,  # the dense layer's
        "moe_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "rope_theta": 1000000.0,
    },
    "mixtral": {
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "intermediate_size": 48,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 48,
        "rope_theta": 1000000.0,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "head_dim": 32,
        "intermediate_size": 48,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "head_dim": 32,
        "intermediate_size": 128,
        "query_pre_attn_scalar": 24,
        "sliding_window": 16,
        "layer_types": [
            "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
        ],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
    },
}  # fmt: skip


def make_tiny_family_model(
    out_dir: str | os.PathLike, family: str, *, seed: int = 0, config_overrides: dict | None = None
) -> pathlib.Path:
    """Write a tiny random-weight checkpoint of `family` (one of TINY_FAMILIES) with its
    tokenizer into out_dir; return the path."""
    if family not in _CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; supported: {', '.join(_CONFIGS)}")
    config = {**_BASE, **_CONFIGS[family], **(config_overrides or {})}

    def draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        return _draw(name, shape, gen, family)

    return write_hf_checkpoint(out_dir, config, draw, seed)[0]


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, family: str) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        # Gemma's norms scale by (1 + w): the same spread around one.
        return NORM_WEIGHT_STD * noise + (0.0 if family == "gemma3" else 1.0)
    if name.endswith(("bias", "sinks")):
        return BIAS_STD * noise if name.endswith("bias") else noise
    if name.endswith("embed_tokens.weight"):
        return EMBED_STD * noise
    if name == "lm_head.weight":
        return noise * (LM_HEAD_GAIN / shape[1] ** 0.5)
    # Stacked experts: gpt-oss keeps x @ W ([E, in, out]), the others W @ x ([E, out, in]).
    transposed = family == "gpt_oss" and name.endswith(("gate_up_proj", "down_proj"))
    fan_in = shape[-2] if transposed else shape[-1]
    if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj", "w2.weight")):
        return noise * (RESIDUAL_GAIN / fan_in**0.5)
    return noise / fan_in**0.5
