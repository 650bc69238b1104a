"""What the transformer needs to know about a checkpoint, read from its config.json and
generation_config.json.

Nothing here imports torch at import time, so the gateway reads it without loading the engine;
`from_pretrained` reads generation_config.json through transformers' `GenerationConfig`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.engine.families import (
    FULL,
    MLAConfig,
    MoEConfig,
    family_fields,
    is_supported,
    rope_parameters,
    supported_architectures,
)
from splitserve.engine.gguf_cache import resolve_checkpoint

__all__ = ["MLAConfig", "ModelConfig", "MoEConfig", "RopeConfig", "supported_architectures"]

# generation_config.json fields that are default sampling settings, and their SamplingParams name.
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base frequency and optional frequency scaling, as transformers reads
    it: Llama 3 (`factor`, `low_freq_factor`, `high_freq_factor`) or YaRN (`factor`,
    `beta_fast`, `beta_slow`, `truncate`, and the cos/sin scale `attention_factor`, else from
    `mscale` / `mscale_all_dim`); both scale from `original_max_position_embeddings`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3", "yarn"):
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: default, llama3, "
                "yarn"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope_theta and the rope scaling factor must be positive")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("rope original_max_position_embeddings must be positive")
        if self.attention_factor is not None and self.attention_factor < 0:
            raise ValueError("rope attention_factor must be >= 0")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints have
        # `rope_theta` beside an optional `rope_scaling`, which wins where both are given (as
        # in transformers' `convert_rope_params_to_dict`).
        params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        fields = {f.name for f in dataclasses.fields(cls)} - {"theta", "rope_type"}
        # A null entry is an unset one (the field's default; YaRN's factor is derived below).
        extra = {k: v for k, v in params.items() if k in fields and v is not None}
        if rope_type in ("llama3", "yarn"):
            # NOTE: transformers' `standardize_rope_params`: a top-level value (Phi-3 keeps it
            # there) wins over the rope dict's; missing, it is max_position_embeddings.
            original = raw.get("original_max_position_embeddings")
            original = original or extra.get("original_max_position_embeddings")
            original = original or raw.get("max_position_embeddings")
            if original is not None:
                extra["original_max_position_embeddings"] = int(original)
        if rope_type == "yarn" and "factor" not in extra and "max_position_embeddings" in raw:
            # DeepSeek-V3 style: the factor is the ratio of the two context lengths.
            original = extra.get("original_max_position_embeddings", 8192)
            extra["factor"] = raw["max_position_embeddings"] / original
        return cls(theta=float(theta), rope_type=rope_type, **extra)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and traits of a decoder, as read from config.json (the family's: families.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    # Each layer's attention (families.SLIDING or FULL) where they differ; () when alike.
    layer_types: tuple[str, ...] = ()
    # The sliding layers' own RoPE where it differs from the full layers' (Gemma 3).
    rope_local: RopeConfig | None = None
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    moe: MoEConfig | None = None
    # DeepSeek's latent attention (engine/mla.py); `head_dim` is then its RoPE dims.
    mla: MLAConfig | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    o_bias: bool = False
    attn_sinks: bool = False  # a learned per-head softmax sink in every layer (gpt-oss)
    # Gemma: norms around both sub-layers' outputs too, embeddings scaled by this, norm
    # weights stored as an offset from this (added at load).
    sandwich_norms: bool = False
    embed_scale: float | None = None
    norm_offset: float = 0.0
    bos_token_id: int | None = None
    # config.json's eos_token_id, then generation_config.json's (instruct models keep their
    # end-of-turn ids there), without repeats.
    eos_token_ids: tuple[int, ...] = ()
    # The checkpoint's `torch_dtype` ("bfloat16", …), which `--dtype auto` follows.
    torch_dtype: str | None = None
    # Sampling settings from generation_config.json, as (SamplingParams field, value): what a
    # request that leaves a field unset gets.
    generation_defaults: tuple[tuple[str, float | int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive")
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a positive "
                f"multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it sees the whole context)."""
        if self.layer_types and self.layer_types[layer] == FULL:
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read `model_dir/config.json`; raise ValueError naming what is missing or unsupported.

        A GGUF file (or a directory holding one) is converted first: `gguf_cache`."""
        path = resolve_checkpoint(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(
                f"{str(path)!r} has no config.json; is it an HF-format model directory?"
            )
        raw = json.loads(cfg_file.read_text())
        config = cls.from_hf_dict(raw, source=str(cfg_file))
        if not (path / "generation_config.json").is_file():
            return config
        return config.with_generation_config(_read_generation_config(path))

    def with_generation_config(self, generation: dict[str, Any]) -> ModelConfig:
        """This config with generation_config.json's EOS ids added and its sampling defaults."""
        eos = (*self.eos_token_ids, *_as_ids(generation.get("eos_token_id")))
        defaults = tuple(
            (name, generation[key])
            for key, name in _GENERATION_DEFAULTS.items()
            if generation.get(key) is not None
        )
        return dataclasses.replace(
            self, eos_token_ids=tuple(dict.fromkeys(eos)), generation_defaults=defaults
        )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if is_supported(a)), None)
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(supported_architectures())}"
            )
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
            if k not in raw
        ]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {', '.join(missing)}")
        num_heads = int(raw.get("num_attention_heads", 0))
        head_dim = raw.get("head_dim") or (raw["hidden_size"] // max(num_heads, 1))
        family = family_fields(arch, raw, source)
        if "mla" in family:  # the rotary's width: MLA turns only the RoPE part of each head
            head_dim = family["mla"].qk_rope_head_dim
        full_rope, local_rope = rope_parameters(raw)
        # Qwen2/3 configs carry a sliding_window value even when use_sliding_window is false.
        window = raw.get("sliding_window")
        if raw.get("use_sliding_window") is False:
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_model_len=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(full_rope),
            rope_local=RopeConfig.from_hf(local_rope) if local_rope is not None else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_ids(raw.get("eos_token_id")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            **family,
        )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _read_generation_config(path: Path) -> dict[str, Any]:
    """The fields generation_config.json sets, checked by transformers' `GenerationConfig`."""
    from transformers import GenerationConfig  # NOTE: here: transformers loads torch

    try:
        loaded = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(path)!r}: unreadable generation_config.json: {exc}") from None
    explicit = json.loads((path / "generation_config.json").read_text())
    return {key: getattr(loaded, key, explicit[key]) for key in explicit}
