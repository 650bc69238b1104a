"""What llama.cpp's converter wrote for each GGUF architecture we read, and the HF form behind it.

Per architecture: the HF `architectures` name, llama.cpp's tensor names back to HF's, what the
converter did to the tensors (and `gguf_loader` undoes), and the metadata keys back to a
config.json dict (`hf_config`).

What the converter did (convert_hf_to_gguf.py):
- `llama` (and Mistral, written as `llama`): Q and K rows permuted for llama.cpp's RoPE
  (`gguf_loader.unpermute_qk`); `qwen2`, `qwen3`, `gemma3`: not permuted.
- `gemma3`: 1 added to every `*norm.weight` (Gemma's RMSNorm scales by `1 + w`; llama.cpp's by
  `w`), so `norm_shift` is subtracted again; the token embedding cut to the tokenizer's
  vocabulary (the config's `vocab_size` is therefore the token count). The sliding-window
  pattern (every 6th layer full attention), the sliding layers' RoPE base (10000) and the
  attention scale are not stored: llama.cpp's loader hardcodes them (llama-model.cpp), and so
  do we, reading a stored key first where newer files have one.

Nothing here imports numpy, torch or `gguf`: it maps names and metadata only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"  # HF's `layer_types` words
FULL = "full_attention"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's "sandwich" norms: one before and one after each sub-layer.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")

# llama.cpp's constants for Gemma 3 (llama-model.cpp, LLM_ARCH_GEMMA3).
GEMMA3_SLIDING_PATTERN = 6  # layers 5, 11, 17, … attend to everything; the others slide
GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is 1/sqrt(hidden / heads)


class GGUFError(ValueError):
    """A GGUF file this engine cannot run (its architecture, a tensor type, a missing key)."""


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp wrote one architecture."""

    hf_architecture: str
    permuted_qk: bool = False  # Q/K rows interleaved by llama.cpp's `permute`
    norm_shift: float = 0.0  # added by llama.cpp to every `*norm.weight`
    layer_names: Mapping[str, str] = field(default_factory=lambda: _LAYER_NAMES)


# GGUF `general.architecture` -> how it was written.
ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM"),
    "qwen3": GGUFArch("Qwen3ForCausalLM"),
    "gemma3": GGUFArch("Gemma3ForCausalLM", norm_shift=1.0, layer_names=_GEMMA3_LAYER_NAMES),
}


def hf_tensor_name(arch: str, gguf_name: str) -> str | None:
    """The HF name of GGUF tensor `gguf_name` of architecture `arch`, or None when llama.cpp's
    name has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = ARCHITECTURES[arch].layer_names
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in names:
        return None
    return f"model.layers.{match[1]}.{names[match[2]]}.{match[3]}"


def is_shifted_norm(arch: str, gguf_name: str) -> bool:
    """Whether llama.cpp added `norm_shift` to this tensor (every `*norm.weight`, as its
    converter tests the HF name; the GGUF names end the same way)."""
    return ARCHITECTURES[arch].norm_shift != 0.0 and gguf_name.endswith("norm.weight")


def hf_config(
    arch: str,
    meta: Mapping[str, Any],
    tensor_names: set[str],
    num_tokens: int,
    special_ids: Mapping[str, int],
    source: str,
) -> dict[str, Any]:
    """config.json for GGUF metadata `meta` (tokenizer keys aside): the keys llama.cpp writes
    for these families. `num_tokens`: the tokenizer's vocabulary size; `special_ids`: its
    `bos`, `eos` and `padding` token ids where present."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{source}: metadata key {arch}.{name} is missing")
        return value

    num_heads = int(key("attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per layer; only a uniform count can run here
        if len(set(num_kv_heads)) != 1:
            raise GGUFError(f"{source}: a KV head count that varies by layer is not supported")
        num_kv_heads = num_kv_heads[0]
    hidden = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"{source}: partial rotary ({rope_dim} of {head_dim} dims) unsupported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and not (arch == "gemma3" and scaling == "linear"):
        raise GGUFError(f"{source}: RoPE scaling {scaling!r} is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or num_tokens
    if not vocab:
        raise GGUFError(f"{source}: no {arch}.vocab_size and no tokenizer vocabulary to count")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch].hf_architecture],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
    }
    if arch == "gemma3":
        config.update(_gemma3_fields(key, meta, config, source))
    else:
        config["rope_theta"] = float(meta.get(f"{arch}.rope.freq_base") or 10000.0)
        config["hidden_act"] = "silu"
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    for name in ("bos", "eos", "padding"):
        if name in special_ids:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(
                special_ids[name]
            )
    return config


def _gemma3_fields(
    key: Any, meta: Mapping[str, Any], config: Mapping[str, Any], source: str
) -> dict[str, Any]:
    """Gemma 3's own config.json fields, in the form transformers' `Gemma3TextConfig` takes:
    RoPE keyed by layer type, each layer's attention kind listed."""
    num_layers = int(config["num_hidden_layers"])
    pattern = meta.get("gemma3.attention.sliding_window_pattern")  # newer files: True = sliding
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise GGUFError(f"{source}: sliding_window_pattern does not name every layer")
        layer_types = [SLIDING if sliding else FULL for sliding in pattern]
    else:
        layer_types = [
            FULL if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else SLIDING for i in range(num_layers)
        ]
    full_rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get("gemma3.rope.freq_base") or 1_000_000.0),
    }
    if meta.get("gemma3.rope.scaling.type") == "linear":  # the full layers' only (4B and up)
        full_rope.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    local_theta = meta.get("gemma3.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_THETA
    # NOTE: llama.cpp scales scores by 1/sqrt(head_dim), except for the 27B model's
    # 1/sqrt(hidden / heads); HF's `query_pre_attn_scalar` is what goes under that root.
    hidden, num_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    scalar = hidden // num_heads if num_layers == _GEMMA3_27B_LAYERS else config["head_dim"]
    return {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(scalar),
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": layer_types,
        "rope_parameters": {
            FULL: full_rope,
            SLIDING: {"rope_type": "default", "rope_theta": float(local_theta)},
        },
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),
        "use_bidirectional_attention": False,
    }
