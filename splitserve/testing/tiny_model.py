"""Tiny random-weight Hugging Face checkpoints for tests that must run offline.

``make_tiny_model`` writes a complete HF-format model directory (config, safetensors weights,
generation config and a locally trained tokenizer) for a few decoder-only architectures, so the
engine can be compared token for token against ``transformers`` without downloading anything.

The weights are scaled so that logits are peaky: greedy decoding then has clear top-1 margins
and float32 reductions in a different order (our kernels vs. HF's) do not flip the argmax.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors.torch import save_file

from splitserve.testing.archs import SUPPORTED_TINY_ARCHS as SUPPORTED_TINY_ARCHS
from splitserve.testing.tiny_tokenizer import (
    BOS_TOKEN,
    CHATML_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    build_tokenizer,
    write_tokenizer_files,
)

# Init scales, tuned empirically (see tests) so that greedy decoding is varied, depends on the
# context, and has clear top-1 margins. Logits have std ~4: for untied models via LM_HEAD_GAIN
# (the final norm makes the hidden state's RMS ~1, so logit std ~ gain); for tied models via
# EMBED_STD * sqrt(hidden) = 0.5 * 8.
LM_HEAD_GAIN = 4.0
EMBED_STD = 0.5
# With tied embeddings, logit_t of the current token t contains |e_t|^2, which makes a random
# model copy its input forever. Sub-layers writing ~8x louder into the residual stream than the
# embedding drown that self term, as in trained models whose residual stream outgrows the input.
RESIDUAL_GAIN = 8.0
NORM_WEIGHT_STD = 0.1
BIAS_STD = 0.1


def _arch_config(arch: str) -> dict:
    # Built per call (not a module-level dict) so that merging into a config never aliases
    # shared nested values such as rope_scaling.
    configs = {
        "llama": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            # A small original context so that the llama3 frequency scaling changes the rotation
            # for the positions tests actually reach.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
        },
        "mistral": {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "num_key_value_heads": 4,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            "sliding_window": None,
        },
        "qwen2": {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
        },
        "qwen3": {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            # Deliberately != hidden_size / num_attention_heads, as in real Qwen3 checkpoints.
            "head_dim": 32,
            "attention_bias": False,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
        },
    }
    return configs[arch]


def _build_config(arch: str, tokenizer_vocab_size: int, special_ids: dict, overrides: dict):
    config = {
        "vocab_size": tokenizer_vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
        **special_ids,
    }
    config.update(_arch_config(arch))
    config.update(overrides)
    return config


def _param_shapes(arch: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Return name -> shape for every stored tensor, in HF module order."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // n_heads
    vocab = config["vocab_size"]
    attn_bias = config.get("attention_bias", False)
    # Qwen2 hard-codes q/k/v biases (and never an o_proj bias) regardless of the config.
    qkv_bias = arch == "qwen2" or (arch != "mistral" and attn_bias)
    o_bias = arch in ("llama", "qwen3") and attn_bias
    mlp_bias = arch == "llama" and config.get("mlp_bias", False)

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        projections = {
            "self_attn.q_proj": (n_heads * head_dim, hidden, qkv_bias),
            "self_attn.k_proj": (n_kv * head_dim, hidden, qkv_bias),
            "self_attn.v_proj": (n_kv * head_dim, hidden, qkv_bias),
            "self_attn.o_proj": (hidden, n_heads * head_dim, o_bias),
            "mlp.gate_proj": (inter, hidden, mlp_bias),
            "mlp.up_proj": (inter, hidden, mlp_bias),
            "mlp.down_proj": (hidden, inter, mlp_bias),
        }
        for name, (out_f, in_f, has_bias) in projections.items():
            shapes[f"{p}{name}.weight"] = (out_f, in_f)
            if has_bias:
                shapes[f"{p}{name}.bias"] = (out_f,)
            if name == "self_attn.o_proj" and arch == "qwen3":
                shapes[f"{p}self_attn.q_norm.weight"] = (head_dim,)
                shapes[f"{p}self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + NORM_WEIGHT_STD * noise
    if name.endswith(".bias"):
        return BIAS_STD * noise
    if name == "model.embed_tokens.weight":
        return EMBED_STD * noise
    if name == "lm_head.weight":
        return noise * (LM_HEAD_GAIN / shape[1] ** 0.5)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return noise * (RESIDUAL_GAIN / shape[1] ** 0.5)
    # Fan-in scaling: unit-RMS (normed) inputs give unit-RMS projections, so attention scores and
    # MLP gates are neither saturated nor flat.
    return noise / shape[1] ** 0.5


def _shard_names(names: list[str], num_shards: int) -> list[list[str]]:
    # Contiguous, count-balanced chunks: every shard is non-empty and layers stay together.
    base, extra = divmod(len(names), num_shards)
    chunks, start = [], 0
    for k in range(num_shards):
        size = base + (1 if k < extra else 0)
        chunks.append(names[start : start + size])
        start += size
    return chunks


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_weights(out: pathlib.Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    # Rebuilding into a used directory must not leave weights of another layout behind: HF would
    # prefer a stale model.safetensors over a fresh index, or vice versa.
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for k, chunk in enumerate(_shard_names(list(tensors), num_shards), start=1):
        filename = f"model-{k:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(out / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(chunk, filename))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total_size}, "weight_map": weight_map},
    )


def make_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    config_overrides: dict | None = None,
    num_shards: int = 1,
    add_bos: bool = False,
    chat_template: str | None = CHATML_TEMPLATE,
    generation_config: dict | None = None,
) -> pathlib.Path:
    """Write a tiny random-weight HF-format checkpoint (config.json, model.safetensors or sharded
    model-0000k-of-0000n.safetensors + model.safetensors.index.json, generation_config.json,
    tokenizer.json, tokenizer_config.json, special_tokens_map.json) into out_dir; return the path.

    ``config_overrides`` is merged into config.json last and the weight shapes follow the merged
    config. The same arguments always produce byte-identical files.
    ``add_bos`` makes the tokenizer add BOS (as Llama's and Mistral's do); ``chat_template``
    is the tokenizer's (None: no template); ``generation_config`` is merged into
    generation_config.json.
    """
    if arch not in SUPPORTED_TINY_ARCHS:
        raise ValueError(
            f"unknown tiny arch {arch!r}; supported: {', '.join(SUPPORTED_TINY_ARCHS)}"
        )
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")

    tokenizer = build_tokenizer(qwen2_pipeline=arch == "qwen2", add_bos=add_bos)
    special_ids = {
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "pad_token_id": tokenizer.token_to_id(PAD_TOKEN),
    }
    config = _build_config(
        arch, tokenizer.get_vocab_size(with_added_tokens=True), special_ids, config_overrides or {}
    )
    shapes = _param_shapes(arch, config)
    if num_shards > len(shapes):
        raise ValueError(f"num_shards={num_shards} exceeds the {len(shapes)} tensors to store")

    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init_tensor(name, shape, gen) for name, shape in shapes.items()}

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            **{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
            **(generation_config or {}),
        },
    )
    _write_weights(out, tensors, num_shards)
    write_tokenizer_files(
        out,
        tokenizer,
        model_max_length=config["max_position_embeddings"],
        add_bos=add_bos,
        chat_template=chat_template,
    )
    return out


# DeepSeek-V2 / V3 (Multi-head Latent Attention, DeepSeek MoE): built by transformers from its
# config class, so the checkpoint is exactly what transformers saves (stacked experts).
