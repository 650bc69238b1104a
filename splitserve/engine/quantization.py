"""FP8 (e4m3) weights for every linear layer of the decoder: what a checkpoint says, how a
weight is quantized, and the reference arithmetic every backend is checked against.

Two ways in, one representation:

- a pre-quantized checkpoint in the `compressed-tensors` FP8 format (config.json
  `quantization_config`, `quant_method: compressed-tensors`, `format: float-quantized` or
  `naive-quantized`): each targeted `*.weight` is float8_e4m3fn with a `*.weight_scale` per
  tensor ([1]) or per output channel ([N, 1]), and a static `*.input_scale` when activations
  are statically quantized;
- `--quantization fp8` on a 16/32-bit checkpoint: weights quantized at load, per channel.

In the model a quantized projection holds its weight as float8_e4m3fn [N, K] with a float32
`weight_scale` [N] (a per-tensor scale is broadcast to every channel, so merged q/k/v and
gate/up weights keep one scale per row) and, for static activations, a float32 `input_scale`
[1]. The arithmetic (`fp8_linear_ref`): activations quantized per token (dynamic, or by the
static scale), both operands widened to float32, scaled, multiplied, accumulated in float32.
On a GPU the same quantized operands go through FP8 tensor cores (kernels/fp8_skinny.py up to
64 rows, `torch._scaled_mm` above) or, for one row, the FP8 GEMV kernel. The LM head and the
embedding stay in the model's dtype.

Mixture-of-Experts experts (`--quantization fp8` only; a compressed-tensors checkpoint of an MoE
model is refused): the stacked `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj`
[E, H, I] become float8_e4m3fn with `gate_up_proj_scale` [E, 2I] / `down_proj_scale` [E, H],
one float32 scale per expert and output channel. Their arithmetic is weight-only: activations
stay 16-bit (kernels/moe_ref.py says exactly what is computed; the Triton kernel widens each
e4m3 tile in registers, so at decode it reads half the bytes). The router stays 16-bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitserve.kernels.fp8_ref import FP8, FP8_MAX, quantize_rows_ref, skinny_fp8_gemm_ref

QUANTIZATIONS = ("none", "fp8")
TARGET_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
"""The projections that are quantized (every decoder Linear; never the LM head)."""
EXPERTS_SUFFIX = "mlp.experts"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""A Mixture-of-Experts block's stacked expert weights (engine/moe.py `Experts`); each gets a
`<name>_scale` [E, rows] when quantized."""


@dataclass(frozen=True)
class QuantConfig:
    """FP8 weights: `prequantized` when the checkpoint stores them; `static_input` when it also
    stores one activation scale per projection (else activations are scaled per token)."""

    prequantized: bool
    static_input: bool = False


def resolve(model_dir: str | Path, requested: str | None) -> QuantConfig | None:
    """What to run: the checkpoint's own FP8 quantization, or `requested` ("fp8" quantizes a
    16/32-bit checkpoint at load; "none" or None leaves it as stored). A checkpoint quantized in
    a format this engine does not read fails here, naming it."""
    if requested not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization {requested!r}: choose one of {list(QUANTIZATIONS)}")
    raw = _read_config(model_dir).get("quantization_config")
    if raw and raw.get("quant_method") == "mxfp4":
        # gpt-oss: MXFP4 experts are dequantized at load (engine/moe.py); the rest is 16-bit.
        raw = None
    if raw:
        stored = _from_compressed_tensors(raw)
        if requested == "none":
            raise ValueError(f"{model_dir}: the checkpoint is FP8; it can't be run unquantized")
        return stored
    return QuantConfig(prequantized=False) if requested == "fp8" else None


def _read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _from_compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    method = raw.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; FP8 checkpoints in "
            "the compressed-tensors format are"
        )
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: expected one config group, found {len(groups)}")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors weights {weights}: only 8-bit float (FP8) is read")
    if weights.get("strategy") not in ("tensor", "channel"):
        raise ValueError(f"compressed-tensors weight strategy {weights.get('strategy')!r}")
    static_input = bool(inputs) and not inputs.get("dynamic", True)
    if static_input and inputs.get("strategy") != "tensor":
        raise ValueError(f"compressed-tensors static activations {inputs}: per tensor only")
    ignored = set(raw.get("ignore") or ())
    if ignored - {"lm_head"}:
        raise ValueError(f"compressed-tensors ignore list {sorted(ignored)}: only lm_head")
    return QuantConfig(prequantized=True, static_input=static_input)


# -- the arithmetic --------------------------------------------------------------------------


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: (float8 weight [N, K], float32 scale [N]), weight ~ q * scale."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activation(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 x [M, K], float32 scale [M, 1]): per token, or by the static scale."""
    return quantize_rows_ref(x, input_scale)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantized weight^T (+ bias) in float32, returned in x's dtype."""
    xq, xs = quantize_activation(x, input_scale)
    return skinny_fp8_gemm_ref(xq, xs, weight, weight_scale, bias, out_dtype=x.dtype)


# -- the model --------------------------------------------------------------------------------


def targets(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(TARGET_SUFFIXES):
            yield name, module


def expert_targets(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The Mixture-of-Experts blocks' `experts` modules (stacked `EXPERT_WEIGHTS`)."""
    for name, module in model.named_modules():
        if name.endswith(EXPERTS_SUFFIX) and all(hasattr(module, w) for w in EXPERT_WEIGHTS):
            yield name, module


def prepare(model: nn.Module, cfg: QuantConfig) -> None:
    """Give every targeted projection of a model still on the meta device the parameters a
    pre-quantized checkpoint fills: an FP8 weight, its scale and (static) input scale."""
    if any(True for _ in expert_targets(model)):
        raise ValueError(
            "FP8 compressed-tensors checkpoints of Mixture-of-Experts models are not supported; "
            "load the 16-bit checkpoint with --quantization fp8 (experts quantized at load)"
        )
    for _, module in targets(model):
        n, k = module.weight.shape
        module.weight = nn.Parameter(torch.empty(n, k, dtype=FP8), requires_grad=False)
        module.weight_scale = nn.Parameter(torch.empty(n), requires_grad=False)
        if cfg.static_input:
            module.input_scale = nn.Parameter(torch.empty(1), requires_grad=False)


@torch.no_grad()
def quantize_model(model: nn.Module) -> None:
    """Quantize every targeted projection and every MoE block's experts of a loaded 16/32-bit
    model in place."""
    for _, module in targets(model):
        q, scale = quantize_weight(module.weight.data)
        module.weight = nn.Parameter(q, requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
    for _, experts in expert_targets(model):
        for name in EXPERT_WEIGHTS:
            q, scale = quantize_experts(getattr(experts, name).data)
            setattr(experts, name, nn.Parameter(q, requires_grad=False))
            setattr(experts, f"{name}_scale", nn.Parameter(scale, requires_grad=False))


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] -> (float8 [E, N, K], float32 scale [E, N]): per expert
    and output channel, `quantize_weight` over the [E * N, K] rows."""
    q, scale = quantize_weight(weight.flatten(0, 1))
    return q.view(weight.shape), scale.view(weight.shape[:2])


def checkpoint_scale(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A stored `weight_scale` ([1], [], [N] or [N, 1]) as [N] (`input_scale` as [1])."""
    flat = tensor.float().reshape(-1)
    if name.endswith("input_scale"):
        if flat.numel() != 1:
            raise ValueError(f"{name}: a static input scale must be one value, got {tensor.shape}")
        return flat
    if flat.numel() == 1:
        return flat.expand(rows)
    if flat.numel() != rows:
        raise ValueError(f"{name}: {tuple(tensor.shape)} scales for a weight of {rows} rows")
    return flat


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter (FP8 weights count one byte per element)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
