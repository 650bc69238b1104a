"""Write an FP8 checkpoint in the compressed-tensors format from a 16/32-bit one: what the public
"…-FP8" checkpoints look like, so that loading them is tested on real files.

Every decoder projection's weight becomes float8_e4m3fn with a float32 `weight_scale` (per
output channel [N, 1], or per tensor [1]); with `static_input`, each projection also gets an
`input_scale` [1] (the largest activation seen is unknown here, so a fixed value that covers
the tiny models' activations). Everything else (embedding, norms, LM head, tokenizer, generation
config) is copied as it is; config.json gains the `quantization_config` such checkpoints carry.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import torch
from safetensors.torch import save_file

from splitserve.engine.quantization import FP8, FP8_MAX, TARGET_SUFFIXES
from splitserve.engine.weights import iter_tensors

STATIC_INPUT_SCALE = 8.0 / FP8_MAX
"""The static activation scale written with `static_input` (activations within +-8)."""


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    strategy: str = "channel",
    static_input: bool = False,
) -> pathlib.Path:
    """Write `src` quantized to FP8 into `dst` (one model.safetensors); return `dst`."""
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")
    source, out = pathlib.Path(src), pathlib.Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors(source):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.endswith(TARGET_SUFFIXES):
            w = tensor.float()
            if strategy == "channel":  # [N, 1], as stored
                scale = stored = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            else:  # one value, stored as [1]
                scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(1, 1)
                stored = scale.reshape(1)
            tensors[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            tensors[f"{module}.weight_scale"] = stored
            if static_input:
                tensors[f"{module}.input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
        else:
            tensors[name] = tensor.contiguous()
    for file in source.iterdir():
        if file.is_file() and not file.name.startswith("model") and file.name != "config.json":
            shutil.copy(file, out / file.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(strategy, static_input)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _quantization_config(strategy: str, static_input: bool) -> dict:
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    activations = (
        {**fp8, "strategy": "tensor", "dynamic": False}
        if static_input
        else {**fp8, "strategy": "token", "dynamic": True}
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": strategy, "dynamic": False},
                "input_activations": activations,
            }
        },
    }
