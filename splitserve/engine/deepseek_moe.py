"""DeepSeek's Mixture-of-Experts block (DeepSeek-V2 and -V3): group-limited routing, routed
experts (engine/moe.py's stacked `Experts` through `ops.fused_moe`) and shared experts.

Routing follows transformers operation for operation, in float32 (`route`):

- V2 ("deepseek_softmax"): a softmax over every expert; with groups, each group is ranked by
  its best expert, the `topk_groups` best kept and the others' scores zeroed; the top k of what
  is left, never renormalised.
- V3 ("deepseek_sigmoid"): sigmoid scores; `e_score_correction_bias` is added for the choice
  only (groups ranked by the sum of their two best biased scores, the others masked out, the
  top k of the rest), the weights are the unbiased scores, renormalised (`norm_topk_prob`).

Both multiply the weights by `routed_scaling_factor`. The shared experts, one MLP as wide as
`n_shared_experts` experts, see every token; their output is added to the routed one.

NOTE: the router weight and bias are cast to the model's dtype with the rest (transformers keeps
them in float32): routing in bf16 may pick differently from HF where two scores nearly tie.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model_config import ModelConfig, MoEConfig
from splitserve.engine.moe import Experts
from splitserve.engine.ops import TorchOps


class Router(nn.Module):
    """The router `gate`: weight [E, H] and, for V3, the selection bias [E]."""

    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.router == "deepseek_sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))


class DeepseekMoE(nn.Module):
    """Routed experts plus the `shared` MLP (None: no shared experts)."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps, shared: nn.Module | None) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.moe = cfg.moe
        self.ops = ops
        self.gate = Router(cfg.moe, cfg.hidden_size)
        self.experts = Experts(cfg.moe, cfg.hidden_size)
        self.shared_experts = shared
        self.lora = None  # LoRA hooks look for it; experts take no adapters
        self._router_f32: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None

    def merge_projections(self) -> None:
        if self.shared_experts is not None:
            self.shared_experts.merge_projections()  # type: ignore[operator]

    def router_weight(self) -> torch.Tensor:
        """The router's weight in float32 (routing runs in float32), cast once per weight
        tensor rather than every step: the same values, one launch less a layer. Cast again
        for a new tensor, new storage or an in-place write (its version counter)."""
        param, cached = self.gate.weight, self._router_f32
        key = (param.data_ptr(), param._version)
        if cached is None or cached[0] is not param or cached[1] != key:
            cached = self._router_f32 = (param, key, param.detach().float())
        return cached[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.router_weight())
        moe = self.moe
        if moe.router == "deepseek_softmax" and moe.num_groups == 1:
            # NOTE: V2's greedy top-k is the softmax top-k router without renormalisation:
            # one fused launch on a GPU (kernels/moe_route.py) where torch takes several.
            weights, ids = self.ops.moe_route(logits, moe.top_k, "softmax_topk", False)
            if moe.routed_scaling_factor != 1.0:
                weights = weights * moe.routed_scaling_factor
        else:
            bias = self.gate.e_score_correction_bias
            weights, ids = route(logits, None if bias is None else bias.float(), moe)
        experts = self.experts
        out = self.ops.fused_moe(
            x,
            experts.gate_up_proj,
            experts.down_proj,
            ids,
            weights,
            activation=self.moe.activation,
            w13_scale=experts.gate_up_proj_scale,
            w2_scale=experts.down_proj_scale,
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from float32 router logits [T, E]."""
    if moe.router == "deepseek_sigmoid":
        return _route_sigmoid(logits, bias, moe)
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if moe.num_groups > 1:
        grouped = scores.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
        keep = _group_mask(grouped.max(dim=-1).values, moe)
        scores = scores.masked_fill(~keep, 0.0)
    weights, ids = torch.topk(scores, k=moe.top_k, dim=-1, sorted=False)
    return weights * moe.routed_scaling_factor, ids


def _route_sigmoid(
    logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
    keep = _group_mask(grouped.topk(2, dim=-1)[0].sum(dim=-1), moe)
    choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def _group_mask(group_scores: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """[T, E] bool: the experts of each token's `topk_groups` best groups."""
    best = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores)
    mask.scatter_(1, best, 1)
    per_group = moe.num_experts // moe.num_groups
    return (
        mask.unsqueeze(-1).expand(-1, moe.num_groups, per_group).reshape(-1, moe.num_experts).bool()
    )
