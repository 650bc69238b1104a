"""The Mixture-of-Experts MLP: a router picks each token's experts (`ops.moe_route`:
kernels/moe_route.py on a GPU), the experts run as one fused grouped computation
(`ops.fused_moe`: kernels/fused_moe.py on a GPU); kernels/moe_ref.py is both elsewhere.

Parameters are kept stacked, the way transformers holds them in memory: `experts.gate_up_proj`
[E, 2I, H] (each expert's gate rows, then its up rows), `experts.down_proj` [E, H, I], the router
`gate` [E, H]. Checkpoints that store one tensor per expert (Qwen3-MoE, Mixtral, DeepSeek) or
gpt-oss's stacked, interleaved layout are put into that form as they load (`checkpoint_targets`);
DeepSeek's block (engine/deepseek_moe.py) reuses `Experts`. Under
`--quantization fp8` the two expert weights become float8_e4m3fn with `gate_up_proj_scale`
[E, 2I] and `down_proj_scale` [E, H] (engine/quantization.py); the router stays 16-bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from splitserve.engine.families import DEEPSEEK_ROUTERS
from splitserve.engine.model_config import ModelConfig, MoEConfig
from splitserve.engine.ops import TorchOps


class Experts(nn.Module):
    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if moe.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.down_proj_bias = nn.Parameter(torch.empty(e, hidden))
        # FP8 (engine/quantization.py quantize_model): per expert and output channel.
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None


class MoE(nn.Module):
    """Sparse MLP block: router `gate` (a Linear, biased for gpt-oss), then the experts."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.moe = cfg.moe
        self.ops = ops
        self.gate = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=cfg.moe.bias)
        self.experts = Experts(cfg.moe, cfg.hidden_size)
        # LoRA hooks look for this attribute on every MLP; experts take no adapters.
        self.lora = None

    def merge_projections(self) -> None:
        """Already one tensor per projection kind."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(x, self.gate.weight, self.gate.bias)
        moe = self.moe
        weights, ids = self.ops.moe_route(logits, moe.top_k, moe.router, moe.renormalize)
        experts = self.experts
        return self.ops.fused_moe(
            x,
            experts.gate_up_proj,
            experts.down_proj,
            ids,
            weights,
            activation=self.moe.activation,
            w13_bias=experts.gate_up_proj_bias,
            w2_bias=experts.down_proj_bias,
            w13_scale=experts.gate_up_proj_scale,
            w2_scale=experts.down_proj_scale,
        )


# Per-expert checkpoint names: (prefix of the layer's MoE block, expert, projection).
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_ROUTER = re.compile(
    r"^(model\.layers\.\d+\.)(?:block_sparse_moe\.gate|mlp\.router)\.(weight|bias)$"
)
_STACKED = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_MXFP4 = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$"
)
_HALF = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}

Target = tuple[str, tuple[int | slice, ...], torch.Tensor]
"""(parameter name, the index of the part of it this tensor fills, the tensor)."""


class CheckpointReader:
    """Puts a checkpoint's Mixture-of-Experts tensors where the stacked parameters want them.

    gpt-oss's MXFP4 experts come as two tensors per projection (`_blocks`, `_scales`), in
    either order: the first is held until its partner arrives, then both are dequantized
    (engine/mxfp4.py) into the dtype of the model's parameters and placed as a stored 16-bit
    projection would be."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        assert cfg.moe is not None
        self.cfg, self.dtype = cfg, dtype
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def targets(self, name: str, tensor: torch.Tensor) -> list[Target] | None:
        """Where `name` goes ([] while it waits for its partner); None: not an MoE tensor."""
        if m := _MXFP4.match(name):
            from splitserve.engine.mxfp4 import dequantize_mxfp4

            halves = self._pending.setdefault(m.group(1), {})
            halves[m.group(2)] = tensor
            if len(halves) < 2:
                return []
            del self._pending[m.group(1)]
            dense = dequantize_mxfp4(halves["blocks"], halves["scales"], self.dtype)
            return list(checkpoint_targets(m.group(1), dense, self.cfg))
        found = list(checkpoint_targets(name, tensor, self.cfg))
        return found or None

    def unpaired(self) -> list[str]:
        """MXFP4 projections whose blocks or scales never came."""
        return sorted(self._pending)


def checkpoint_targets(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Iterator[Target]:
    """Where the checkpoint tensor `name` goes among the MoE parameters; nothing if it is not
    an MoE tensor."""
    assert cfg.moe is not None
    inter = cfg.moe.intermediate_size
    if m := _PER_EXPERT.match(name):
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj in ("down_proj", "w2"):
            yield f"{prefix}mlp.experts.down_proj", (expert,), tensor
        else:
            half = slice(_HALF[proj] * inter, (_HALF[proj] + 1) * inter)
            yield f"{prefix}mlp.experts.gate_up_proj", (expert, half), tensor
    elif m := _ROUTER.match(name):
        yield f"{m.group(1)}mlp.gate.{m.group(2)}", (), tensor
    elif (m := _STACKED.match(name)) and cfg.moe.router in DEEPSEEK_ROUTERS:
        yield name, (), tensor  # stacked as transformers holds them in memory
    elif m := _STACKED.match(name):
        # gpt-oss stores x @ W ([E, H, 2I] / [E, I, H]) with gate and up columns interleaved.
        target = f"{m.group(1)}mlp.experts.{m.group(2)}{m.group(3) or ''}"
        if m.group(2) == "gate_up_proj":
            tensor = _deinterleave(tensor)
        if m.group(3) is None:
            tensor = tensor.transpose(-1, -2)
        yield target, (), tensor


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] columns (g0 u0 g1 u1 …) -> (g0 g1 … | u0 u1 …)."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)
