"""The model families the engine runs: what each HF `architectures` name means for the transformer.

A family is a set of traits read from config.json (`family_fields`), which `ModelConfig` carries
and the model switches on: q/k/v biases, QK-norm, per-layer sliding windows with their own RoPE,
Gemma's sandwich norms and scaled embeddings, gpt-oss's attention sinks, the
Mixture-of-Experts block (`MoEConfig`) where the family has one, and DeepSeek's Multi-head Latent
Attention (`MLAConfig`).

Nothing here imports torch: the gateway reads configs without loading the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# HF `architectures` entry -> fixed traits of the family (the config adds the rest).
_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True, "moe": "qwen3_moe"},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False, "moe": "mixtral"},
    "GptOssForCausalLM": {"qkv_bias": True, "qk_norm": False, "moe": "gpt_oss"},
    "Gemma3ForCausalLM": {"qkv_bias": False, "qk_norm": True, "gemma": True},
    "DeepseekV2ForCausalLM": {
        "qkv_bias": False,
        "qk_norm": False,
        "moe": "deepseek_v2",
        "mla": True,
    },
    "DeepseekV3ForCausalLM": {
        "qkv_bias": False,
        "qk_norm": False,
        "moe": "deepseek_v3",
        "mla": True,
    },
}

# DeepSeek's routers (engine/deepseek_moe.py): group-limited top-k over softmax (V2) or sigmoid
# scores with a selection-only bias (V3).
DEEPSEEK_ROUTERS = ("deepseek_softmax", "deepseek_sigmoid")
# Rotary layouts of MLA's rope dims: DeepSeek-V2's complex pairs (interleaved in and out),
# DeepSeek-V3's interleaved pairs written out as halves, or the usual halves.
MLA_ROPE_LAYOUTS = ("complex", "interleave", "half")

# config.json activation names -> ours.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

# gpt-oss's clamped SwiGLU: the constants the kernels use (kernels/moe_ref.py).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0

SLIDING = "sliding_attention"
FULL = "full_attention"


def supported_architectures() -> tuple[str, ...]:
    """The HF `architectures` names this engine can run."""
    return tuple(_FAMILIES)


def is_supported(arch: str) -> bool:
    return arch in _FAMILIES


@dataclass(frozen=True)
class MoEConfig:
    """A sparse Mixture-of-Experts MLP: a router picks `top_k` of `num_experts` experts per token.

    router "softmax_topk": softmax over every expert's logit, then the top k (Qwen3-MoE,
    Mixtral), rescaled to sum to one when `renormalize`; "topk_softmax": the top k logits, then
    a softmax over those alone (gpt-oss). `bias`: the router and every expert projection have
    biases (gpt-oss). `activation`: "silu" (SwiGLU) or "swiglu_oai" (gpt-oss's clamped one).
    Layers in `dense_layers` have a plain MLP of the config's `intermediate_size` instead.

    DeepSeek (`DEEPSEEK_ROUTERS`): experts in `num_groups` groups of which the best
    `topk_groups` compete, weights times `routed_scaling_factor`, and a shared MLP of
    `shared_intermediate_size` (0: none) added to every token's routed output.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"
    renormalize: bool = True
    bias: bool = False
    activation: str = "silu"
    dense_layers: tuple[int, ...] = ()
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.num_groups <= 0 or self.num_experts % self.num_groups:
            raise ValueError(
                f"config.json: n_group ({self.num_groups}) must divide the number of experts "
                f"({self.num_experts})"
            )
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"config.json: topk_group ({self.topk_groups}) must be between 1 and n_group "
                f"({self.num_groups})"
            )
        if self.num_experts <= 0 or not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok ({self.top_k}) must be between 1 and the "
                f"number of experts ({self.num_experts})"
            )
        if self.intermediate_size <= 0:
            raise ValueError("config.json: the experts' intermediate size must be positive")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's Multi-head Latent Attention (engine/mla.py): queries straight from the hidden
    state (`q_lora_rank` None) or through a rank-`q_lora_rank` bottleneck; keys and values from
    a per-token latent of `kv_lora_rank` values plus one shared RoPE key of `qk_rope_head_dim`,
    which is all the KV cache holds. `softmax_scale` is HF's (YaRN's mscale folded in)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_layout: str
    softmax_scale: float

    def __post_init__(self) -> None:
        dims = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(dims) <= 0 or (self.q_lora_rank is not None and self.q_lora_rank <= 0):
            raise ValueError("config.json: MLA ranks and head dims must be positive")
        if self.qk_rope_head_dim % 2:
            raise ValueError("config.json: qk_rope_head_dim must be even")
        if self.rope_layout not in MLA_ROPE_LAYOUTS:
            raise ValueError(f"MLA rope layout must be one of {MLA_ROPE_LAYOUTS}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values one token keeps per layer in the KV cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def family_fields(arch: str, raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The `ModelConfig` fields that depend on the family, read from config.json `raw`."""
    traits = _FAMILIES[arch]
    act_name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act_name not in _ACTIVATIONS:
        raise ValueError(
            f"{source}: unsupported activation {act_name!r}; supported: {', '.join(_ACTIVATIONS)}"
        )
    num_layers = int(raw["num_hidden_layers"])
    fields: dict[str, Any] = {
        "qkv_bias": traits["qkv_bias"] or bool(raw.get("attention_bias", False)),
        "qk_norm": traits["qk_norm"],
        "hidden_act": _ACTIVATIONS[act_name],
        "layer_types": _layer_types(raw, num_layers, source),
    }
    moe = traits.get("moe")
    if moe is not None:
        fields["moe"] = _moe_config(moe, raw, num_layers)
    if traits.get("mla"):
        fields["mla"] = _mla_config(arch, raw)
        fields["o_bias"] = bool(raw.get("attention_bias", False))
        if raw.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias is not supported for {arch}")
    if moe == "gpt_oss":
        fields["o_bias"] = True
        fields["attn_sinks"] = True
        for key, want in (("swiglu_limit", SWIGLU_OAI_LIMIT), ("swiglu_alpha", SWIGLU_OAI_ALPHA)):
            if float(raw.get(key, want)) != want:
                raise ValueError(f"{source}: {key} {raw[key]} is not supported (only {want})")
    if traits.get("gemma"):
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if raw.get(key) is not None:
                raise ValueError(f"{source}: {key} is not supported")
        fields["sandwich_norms"] = True
        fields["norm_offset"] = 1.0
        fields["embed_scale"] = float(raw["hidden_size"]) ** 0.5
        fields["attn_scale"] = float(raw.get("query_pre_attn_scalar", 256)) ** -0.5
    return fields


def rope_parameters(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the full layers' RoPE settings, the sliding layers' own or None) in the shape
    `RopeConfig.from_hf` reads. transformers 5 keys `rope_parameters` by layer type where the
    two differ (Gemma 3); older Gemma 3 configs give `rope_local_base_freq` instead."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        local = params.get(SLIDING)
        return {"rope_parameters": params[FULL]}, (
            {"rope_parameters": local} if local is not None else None
        )
    if "rope_local_base_freq" in raw:
        return raw, {"rope_theta": raw["rope_local_base_freq"]}
    return raw, None


def _layer_types(raw: dict[str, Any], num_layers: int, source: str) -> tuple[str, ...]:
    """Each layer's attention, SLIDING or FULL; () when every layer is alike (the global
    `sliding_window`, if any, applies to all)."""
    types = raw.get("layer_types")
    if not types:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
        if not pattern or raw.get("sliding_window") is None:
            return ()
        types = [SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(
            f"{source}: layer_types must name {num_layers} layers, each {SLIDING!r} or {FULL!r}"
        )
    if SLIDING in types and not raw.get("sliding_window"):
        raise ValueError(f"{source}: sliding layers need a sliding_window")
    return tuple(types)


def _moe_config(family: str, raw: dict[str, Any], num_layers: int) -> MoEConfig:
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 0)
    if family == "qwen3_moe":
        step = int(raw.get("decoder_sparse_step", 1))
        only_mlp = set(raw.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in only_mlp or step <= 0 or (i + 1) % step)
        return MoEConfig(
            experts,
            top_k,
            int(raw["moe_intermediate_size"]),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            dense_layers=dense,
        )
    if family == "mixtral":
        return MoEConfig(experts, top_k, int(raw["intermediate_size"]))
    if family in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe_config(family, raw, num_layers)
    return MoEConfig(
        experts,
        top_k,
        int(raw["intermediate_size"]),
        router="topk_softmax",
        bias=True,
        activation="swiglu_oai",
    )


def _deepseek_moe_config(family: str, raw: dict[str, Any], num_layers: int) -> MoEConfig:
    """DeepSeek's MoE as transformers runs it: V2 a softmax, its top k over every expert
    ("greedy") or over the best groups ("group_limited_greedy"), never renormalised; V3 a
    sigmoid, groups ranked with the correction bias, renormalised when `norm_topk_prob`."""
    experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 0)
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    if family == "deepseek_v2":
        method = raw.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"config.json: topk_method {method!r} is not supported")
        grouped = method == "group_limited_greedy"
    else:
        grouped = True
    groups = int(raw.get("n_group") or 1) if grouped else 1
    return MoEConfig(
        experts,
        int(raw.get("num_experts_per_tok") or 0),
        int(raw["moe_intermediate_size"]),
        router="deepseek_softmax" if family == "deepseek_v2" else "deepseek_sigmoid",
        renormalize=family == "deepseek_v3" and bool(raw.get("norm_topk_prob", True)),
        dense_layers=tuple(range(min(first_dense, num_layers))),
        num_groups=groups,
        topk_groups=int(raw.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=int(raw["moe_intermediate_size"])
        * int(raw.get("n_shared_experts") or 0),
    )


def _mla_config(arch: str, raw: dict[str, Any]) -> MLAConfig:
    """MLA's shapes, rotary layout and softmax scale (transformers' `yarn_apply_mscale`: with
    YaRN and a `mscale_all_dim`, the scale is multiplied by mscale(factor, mscale_all_dim)^2)."""
    q_lora = raw.get("q_lora_rank")
    nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    if arch == "DeepseekV2ForCausalLM":
        layout = "complex"
    else:
        layout = "interleave" if raw.get("rope_interleave", True) else "half"
    scale = float((nope + rope) ** -0.5)
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if rope_type != "default" and mscale_all_dim:
        factor = params.get("factor")
        if factor is None:
            original = params.get("original_max_position_embeddings")
            factor = raw["max_position_embeddings"] / original if original else 1.0
        m = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * m * m
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(raw["v_head_dim"]),
        rope_layout=layout,
        softmax_scale=scale,
    )
