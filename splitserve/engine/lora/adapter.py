"""A LoRA adapter in the PEFT format, read into host memory and checked against the model.

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, ...) and `adapter_model.safetensors` with tensors named

    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight

where A is [r, in_features] and B is [out_features, r]. A projection's output gains
`lora_B(lora_A(x)) * scale`, scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).
What this engine cannot run exactly (DoRA, per-module rank or alpha patterns, trained biases,
extra saved modules, targets outside the seven decoder projections) is refused with the reason,
never loaded approximately.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from splitserve.engine.errors import InvalidRequest, NotFound
from splitserve.engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The modules an adapter may target, in the order of a slot's layout."""

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$"
)
# Config keys whose non-empty value changes the arithmetic in a way this engine does not run.
_REFUSED = {
    "use_dora": "DoRA",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "extra trained modules (modules_to_save)",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "lora_bias": "LoRA biases (lora_bias)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "parameter targets (target_parameters)",
}


def projection_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder projection."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, cfg.q_size),
        "k_proj": (h, cfg.kv_size),
        "v_proj": (h, cfg.kv_size),
        "o_proj": (cfg.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights on the host: `weights[(layer, module)] = (A [r, in], B [out, r])`
    in the model's dtype, and the scale its products are multiplied by."""

    name: str
    path: str
    rank: int
    scale: float
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # Content digest: two adapters are the same only if their weights and scale are.
    digest: str

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(root: Path) -> dict:
    path = root / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{path}: expected a JSON object")
    return raw


def _check_config(raw: dict, path: Path, max_rank: int) -> tuple[int, float]:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidRequest(f"{path}: peft_type {peft_type!r} is not LORA")
    for key, what in _REFUSED.items():
        if raw.get(key):
            raise InvalidRequest(f"{path}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise InvalidRequest(f"{path}: trained biases (bias={raw['bias']!r}) are not supported")
    r = raw.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InvalidRequest(f"{path}: r must be a positive int, got {r!r}")
    if r > max_rank:
        raise InvalidRequest(f"{path}: rank {r} is above --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise InvalidRequest(f"{path}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted({str(t) for t in targets} - set(PROJECTIONS))
        if unsupported:
            raise InvalidRequest(
                f"{path}: target modules {unsupported} are not supported "
                f"(only {', '.join(PROJECTIONS)})"
            )
    scale = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    return r, float(scale)


def load_adapter(
    name: str, path: str | Path, model_config: ModelConfig, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read and check the PEFT adapter in `path`; NotFound if its files are missing,
    InvalidRequest naming what is wrong with them otherwise."""
    root = Path(path)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (root / file).is_file():
            raise NotFound(f"LoRA adapter {name!r}: {root / file} does not exist")
    rank, scale = _check_config(_read_config(root), root / CONFIG_FILE, max_rank)
    tensors = load_file(str(root / WEIGHTS_FILE))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidRequest(f"LoRA adapter {name!r}: unsupported tensor {key!r}")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if layer >= model_config.num_layers:
            raise InvalidRequest(
                f"LoRA adapter {name!r}: {key!r} names layer {layer}, the model has "
                f"{model_config.num_layers}"
            )
        if module in ("gate_proj", "up_proj", "down_proj") and model_config.is_moe_layer(layer):
            raise InvalidRequest(
                f"LoRA adapter {name!r}: {key!r} targets layer {layer}'s MLP, which is a "
                "Mixture-of-Experts block here; adapters on experts are not supported "
                "(attention projections are)"
            )
        halves.setdefault((layer, module), {})[half] = tensor
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    digest = hashlib.blake2b(f"{scale!r}".encode(), digest_size=16)
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise InvalidRequest(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_A or lora_B only"
            )
        in_f, out_f = projection_shape(model_config, module)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise InvalidRequest(
                f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and "
                f"B {tuple(b.shape)}; rank {rank} on this model needs A {(rank, in_f)} and "
                f"B {(out_f, rank)}"
            )
        a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        digest.update(f"{layer}.{module}".encode())
        for t in (a, b):
            digest.update(t.view(torch.uint8).numpy().tobytes())
        weights[(layer, module)] = (a, b)
    if not weights:
        raise InvalidRequest(f"LoRA adapter {name!r}: {root / WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(
        name=name,
        path=str(root),
        rank=rank,
        scale=scale,
        target_modules=frozenset(module for _, module in weights),
        weights=weights,
        digest=digest.hexdigest(),
    )
