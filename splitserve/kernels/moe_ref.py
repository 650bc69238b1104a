"""The plain-torch reference of `kernels/fused_moe.py`'s Mixture-of-Experts layer, same signature.

Each token t is routed to k experts (`topk_ids[t]`) with weights `topk_weights[t]`; expert e is a
gated MLP with its merged gate/up projection `w13[e]` [2I, H] (rows 0..I-1 gate, I..2I-1 up,
nn.Linear layout) and its down projection `w2[e]` [H, I]:

    out[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e])

with e = topk_ids[t, j], computed as HF transformers' Qwen3-MoE, Mixtral and gpt-oss expert
blocks compute it: a loop over the experts some token chose, each running its tokens as one batch
in x's dtype, and an `index_add_` of the weighted output (rounded to x's dtype) into a zeroed
result. An id outside [0, E) (an expert another rank owns, under expert parallelism) contributes
nothing.

FP8 experts (weight-only): with `w13_scale` [E, 2I] / `w2_scale` [E, H] (float32, one per
output channel) that weight is float8_e4m3fn. Each expert a batch uses is dequantized,
w.float() * scale[:, None], and its projection computed as `kernels/gemv.py`'s `gemv_ref`
computes an FP8 weight: F.linear(rows.float(), dequantized weight, bias.float()) in float32,
rounded once to x's dtype. Everything else is as above (activation in x's dtype, the weighted
output rounded to x's dtype). So in float32 the result is bitwise the 16-bit path's on the
dequantized weights; in bf16/fp16 each projection is exact-then-rounded, as the kernel's float32
accumulation is.

Activations: "silu" (Qwen3-MoE, Mixtral, DeepSeek), "gelu_tanh", and "swiglu_oai" (gpt-oss:
gate clamped above at 7, up to [-7, 7], (up + 1) * gate * sigmoid(1.702 * gate)).

The router's reference (`moe_route_ref`, of kernels/moe_route.py) is here too, at the end.

Also here, because both modules need them and this one imports no Triton: the activation names and
`MoeConfig`, the Triton path's tile sizes (the reference ignores it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "ACTIVATIONS", "ROUTERS", "GemmTiles", "MoeConfig", "apply_activation", "fused_moe_ref",
    "moe_route_ref",
]  # fmt: skip

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
ROUTERS = ("softmax_topk", "topk_softmax")  # kernels/moe_route.py
SWIGLU_LIMIT = 7.0  # gpt-oss's swiglu_limit
SWIGLU_ALPHA = 1.702  # gpt-oss's swiglu_alpha


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's tiles: output columns and reduction depth per step (powers of two,
    >= 16 for `tl.dot`), warps and software-pipeline stages of each program."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if (
            not (_pow2(self.block_n) and _pow2(self.block_k))
            or min(self.block_n, self.block_k) < 16
        ):
            raise ValueError(f"block_n and block_k must be powers of two >= 16, got {self}")
        if not _pow2(self.num_warps) or self.num_stages < 1:
            raise ValueError(f"num_warps must be a power of two, num_stages >= 1, got {self}")


@dataclass(frozen=True)
class MoeConfig:
    """The Triton path's tiles: `block_m` rows of one expert per tile (the alignment's tile
    height, shared by both GEMMs), and each GEMM's own `GemmTiles` (`gate_up.block_n` counts the
    columns of each half: a program computes that many gate and as many up columns)."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles

    def __post_init__(self) -> None:
        if not _pow2(self.block_m) or self.block_m < 16:
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def apply_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated activation of the gate and up halves, in their dtype (as HF computes it)."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    check_activation(activation)
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: MoeConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k] (integer), topk_weights [T, k],
    optional w13_bias [E, 2I] and w2_bias [E, H] -> out [T, H] in x's dtype. A `w13_scale`
    [E, 2I] / `w2_scale` [E, H] makes that weight FP8 (the module docstring says how it is
    computed). `config` and `pdl` are the Triton path's and ignored here. Not CUDA-graph safe
    (it asks which experts have tokens)."""
    del config, pdl
    check_activation(activation)
    _check_scale("w13", w13, w13_scale)
    _check_scale("w2", w2, w2_scale)
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    # NOTE: HF's order: experts ascending; within one, its (slot, token) pairs slot-major.
    by_slot = ids.t()
    hit = by_slot[(by_slot >= 0) & (by_slot < num_experts)]
    for expert in torch.unique(hit).tolist():
        slot, token = torch.where(by_slot == expert)
        b13 = None if w13_bias is None else w13_bias[expert]
        b2 = None if w2_bias is None else w2_bias[expert]
        s13 = None if w13_scale is None else w13_scale[expert]
        s2 = None if w2_scale is None else w2_scale[expert]
        gate, up = _project(x[token], w13[expert], b13, s13).chunk(2, dim=-1)
        y = _project(apply_activation(gate, up, activation), w2[expert], b2, s2)
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def _check_scale(name: str, w: torch.Tensor, scale: torch.Tensor | None) -> None:
    """A scale belongs to an FP8 weight, one per output channel; an FP8 weight needs one."""
    if (scale is not None) != (w.dtype == torch.float8_e4m3fn):
        raise ValueError(
            f"{name} is {w.dtype}: an FP8 (float8_e4m3fn) {name} comes with {name}_scale, "
            "a 16/32-bit one without"
        )
    if scale is not None and tuple(scale.shape) != tuple(w.shape[:2]):
        raise ValueError(f"{name}_scale must have shape {tuple(w.shape[:2])}, got {scale.shape}")


def _project(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> torch.Tensor:
    """rows @ weight^T + bias in rows' dtype; an FP8 weight (with its per-channel `scale`)
    dequantized and multiplied in float32, rounded once to rows' dtype (as `gemv_ref`)."""
    if scale is None:
        return F.linear(rows, weight, bias)
    w = weight.float() * scale.float()[:, None]
    b = None if bias is None else bias.float()
    return F.linear(rows.float(), w, b).to(rows.dtype)


def moe_route_ref(
    logits: torch.Tensor, top_k: int, router: str = "softmax_topk", renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels/moe_route.py`'s router top-k as transformers computes it: (weights [T, k] in the
    logits' dtype, expert ids [T, k]) from router logits [T, E]. `softmax_topk`: a float32 softmax
    over every expert, its top k, renormalised if asked (Qwen3-MoE, Mixtral); `topk_softmax`: the
    top k logits, then a softmax over them (gpt-oss)."""
    if router == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids
