"""Model and engine configuration.

`ModelConfig` is what the transformer needs, read from a checkpoint's config.json; `EngineConfig`
holds the engine's own knobs (cache, scheduler, dtype). Both are frozen; values discovered at run
time (the number of KV blocks, say) make a new object with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# HF `architectures` entry -> the family traits our transformer switches on.
_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def supported_architectures() -> tuple[str, ...]:
    """The HF `architectures` names this engine can run."""
    return tuple(_ARCHITECTURES)


def resolve_device(device: str) -> str:
    """ "auto" picks the GPU when there is one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """Turn "float32" / "bfloat16" / "float16" (or a torch dtype) into a torch dtype; "auto" is
    bfloat16 on a GPU and float32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {sorted(_DTYPES)}")
        return dtype
    key = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(
        dtype, dtype
    )
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


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
    eos_token_ids: tuple[int, ...] = ()

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
        """Read `model_dir/config.json`; raise ValueError naming what is missing or unsupported."""
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(
                f"{str(path)!r} has no config.json; is it an HF-format model directory?"
            )
        raw = json.loads(cfg_file.read_text())
        return cls.from_hf_dict(raw, source=str(cfg_file))

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
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
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
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class EngineConfig:
    """The engine's own settings. Defaults suit the CPU; `LLM(**options)` overrides them.

    The KV pool is sized from a memory budget: on a GPU a fraction of the free memory left after
    the weights are loaded, on the CPU `kv_cache_memory_bytes`. `num_kv_blocks` overrides both
    (tests use it to force preemption).
    """

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Record prefix-cache insertions/evictions for a registry's prefix index (decode workers).
    record_prefix_events: bool = False
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None
    scheduling_policy: str = "fcfs"
    # "auto": Triton kernels on CUDA, the plain-torch backend elsewhere.
    attention_backend: str = "auto"
    # "safetensors" reads the checkpoint; "dummy" fills random weights of the config's shape
    # (for benchmarks of large shapes without writing their checkpoints).
    load_format: str = "safetensors"
    # Detokenize every step (services stream text); off, text is made when a sample finishes.
    stream_text: bool = True
    # Capture CUDA graphs for decode batches (one per batch-size bucket).
    enable_cuda_graphs: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError("load_format must be 'safetensors' or 'dummy'")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError("max_model_len must be at least 2")

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)
