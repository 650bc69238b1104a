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

from splitserve.engine.gguf_cache import resolve_checkpoint

# HF `architectures` entry -> the family traits our transformer switches on.
_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}

# generation_config.json fields that are default sampling settings, and their SamplingParams name.
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def supported_architectures() -> tuple[str, ...]:
    """The HF `architectures` names this engine can run."""
    return tuple(_ARCHITECTURES)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base frequency and optional Llama-3 frequency scaling."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: default, llama3"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope_theta and the rope scaling factor must be positive")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints have
        # `rope_theta` beside an optional `rope_scaling`.
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        fields = {f.name for f in dataclasses.fields(cls)} - {"theta", "rope_type"}
        extra = {k: v for k, v in params.items() if k in fields}
        return cls(theta=float(theta), rope_type=rope_type, **extra)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and traits of a Llama-family decoder, as read from config.json."""

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
        arch = next((a for a in archs if a in _ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(_ARCHITECTURES)}"
            )
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
            if k not in raw
        ]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {', '.join(missing)}")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{source}: unsupported hidden_act {hidden_act!r}; only silu")
        num_heads = int(raw.get("num_attention_heads", 0))
        head_dim = raw.get("head_dim") or (raw["hidden_size"] // max(num_heads, 1))
        traits = _ARCHITECTURES[arch]
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
            rope=RopeConfig.from_hf(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=traits["qkv_bias"] or bool(raw.get("attention_bias", False)),
            qk_norm=traits["qk_norm"],
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_ids(raw.get("eos_token_id")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
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
