"""Fused Mixture-of-Experts layer: tokens grouped by expert, two grouped GEMMs, a sum over k.

    align     (token, slot) pairs p = t * k + j, stable-sorted by expert id -> `sorted_pairs`
              [M = T * k], and a tile map: tile i -> (expert, first row, end row) in that list,
              every expert's run cut into tiles of BLOCK_M rows; unused tiles have expert -1
    gate/up   per (tile, BLOCK_N columns): x[token rows] @ w13[e]'s gate and up rows (two
              tensor-core accumulators), + bias, activation -> act [M, I] at the sorted row
    down      per (tile, BLOCK_N columns): act rows @ w2[e]^T, + bias, * topk_weights[pair]
              -> y [M, H] at the pair's own row p
    sum       out[t] = sum over j of y[t * k + j] in slot order (float32, rounded once): no
              atomics, the same bits every run

The tile map (NOTE: what keeps small batches cheap): the expert runs are NOT padded to BLOCK_M in
the sorted list, and no expert gets a slot of its own. The tiles of all experts are numbered
contiguously, so at most M // BLOCK_M + min(E, M) tiles exist (each expert with pairs adds at
most one partial tile), and the GEMM grids are sized for that bound: 8 tiles at batch 1 with
k = 8, however many experts the layer has. An untouched expert owns no tile, so its weights are
never read and no program is launched for it; a tile past the real count exits at once.

    sorted rows   |e3 e3 e3|e7|e9 e9 e9 e9|e9 e9|          (BLOCK_M = 4: e9's 6 rows, 2 tiles)
    tiles         | tile 0 |t1|  tile 2   | t3  | t4: -1 | t5: -1 ...

CUDA-graph safe: nothing here reads a tensor on the host. Every buffer's shape and every grid
depends on T, k, E and the layer's sizes only; the data (which experts, how many rows) is read
by the kernels (the alignment: kernels/moe_align.py, one program per expert). `pick_config`
chooses the tiles by the expected rows per expert, T * k / E.

FP8 weights (weight-only: `w13_scale` [E, 2I] / `w2_scale` [E, H], float32, one per output
channel, with float8_e4m3fn w13 / w2): each K step loads the e4m3 weight tile (half the bytes
of a 16-bit one, which is what a decode step is bound by) and converts it to x's dtype in
registers (exact: every e4m3 value is a bf16, fp16 and float32 value) for the same `tl.dot` on
16-bit activations; after the K loop each accumulator column is multiplied by its channel's
scale, before bias and activation. So the product is sum_k(x * q) * scale in float32, the
reference's dequantized product up to float32 rounding.

An id outside [0, E) (another rank's expert) is in no tile and adds nothing to the sum.
Rounding: gate and up stay float32 into the activation; act and each weighted y are rounded to
x's dtype (as HF rounds them), and the k of them are summed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor, dot_precision
from splitserve.kernels.moe_align import moe_align, num_tiles_bound
from splitserve.kernels.moe_ref import (
    ACTIVATIONS,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    GemmTiles,
    MoeConfig,
    check_activation,
)
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

FP8 = torch.float8_e4m3fn

__all__ = ["MoeConfig", "fused_moe", "moe_align", "num_tiles_bound", "pick_config"]

_LIMIT = tl.constexpr(SWIGLU_LIMIT)
_ALPHA = tl.constexpr(SWIGLU_ALPHA)


@triton.jit
def _activate(gate, up, ACTIVATION: tl.constexpr):
    """The gated activation in float32 (ACTIVATION indexes moe_ref.ACTIVATIONS)."""
    if ACTIVATION == 0:  # silu
        return gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == 1:  # gelu_tanh: tanh(z) = 1 - 2 / (1 + exp(2z)), exact at both ends
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z))) * up
    else:  # swiglu_oai (gpt-oss)
        gate = tl.minimum(gate, _LIMIT)
        up = tl.minimum(tl.maximum(up, -_LIMIT), _LIMIT)
        return (up + 1.0) * gate / (1.0 + tl.exp(gate * -_ALPHA))


@triton.jit
def _tile_rows(tiles_ptr, sorted_ptr, tile, num_tiles, BLOCK_M: tl.constexpr):
    """A live tile's sorted rows [BLOCK_M] (int64), their mask, and their pairs (int64)."""
    first = tl.load(tiles_ptr + num_tiles + tile)
    end = tl.load(tiles_ptr + 2 * num_tiles + tile)
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    pairs = tl.load(sorted_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    return rows.to(tl.int64), row_mask, pairs


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, sorted_ptr, tiles_ptr, act_ptr,
    num_tiles, top_k, H, I, stride_xt, stride_we, stride_wn, stride_be, stride_se,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    num_n = tl.cdiv(I, BLOCK_N)
    tile = tl.program_id(0) // num_n  # NOTE: columns fastest: a tile's programs share x rows
    expert = tl.load(tiles_ptr + tile)
    if expert < 0:
        return
    rows, row_mask, pairs = _tile_rows(tiles_ptr, sorted_ptr, tile, num_tiles, BLOCK_M)
    ns = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < I
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // top_k)[:, None] * stride_xt + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + ns.to(tl.int64)[None, :] * stride_wn
    w_ptrs += ks[:, None]
    up_offset = I * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = ks < H - k0
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        # NOTE: an e4m3 tile is widened to x's dtype here (a no-op for 16-bit weights).
        w_gate = tl.load(w_ptrs, mask=w_mask, other=0.0).to(x_ptr.dtype.element_ty)
        w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0).to(x_ptr.dtype.element_ty)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:  # FP8: each column's dot product times its channel's scale
        s = s_ptr + expert.to(tl.int64) * stride_se + ns
        acc_gate *= tl.load(s, mask=n_mask, other=0.0)[None, :]
        acc_up *= tl.load(s + I, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        b = b_ptr + expert.to(tl.int64) * stride_be + ns
        acc_gate += tl.load(b, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b + I, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    act = _activate(acc_gate, acc_up, ACTIVATION).to(act_ptr.dtype.element_ty)
    tl.store(
        act_ptr + rows[:, None] * I + ns[None, :], act, mask=row_mask[:, None] & n_mask[None, :]
    )


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, b_ptr, s_ptr, sorted_ptr, tiles_ptr, topk_weights_ptr, y_ptr,
    num_tiles, H, I, stride_we, stride_wn, stride_be, stride_se,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    num_n = tl.cdiv(H, BLOCK_N)
    tile = tl.program_id(0) // num_n
    expert = tl.load(tiles_ptr + tile)
    if expert < 0:
        return
    rows, row_mask, pairs = _tile_rows(tiles_ptr, sorted_ptr, tile, num_tiles, BLOCK_M)
    ns = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < H
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * I + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + ns.to(tl.int64)[None, :] * stride_wn
    w_ptrs += ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_mask = ks < I - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w.to(act_ptr.dtype.element_ty), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:
        s = s_ptr + expert.to(tl.int64) * stride_se + ns
        acc *= tl.load(s, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        b = b_ptr + expert.to(tl.int64) * stride_be + ns
        acc += tl.load(b, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    mask = row_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + pairs[:, None] * H + ns[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_kernel(
    y_ptr, ids_ptr, out_ptr, top_k, num_experts, H, stride_ot,
    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = hs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, top_k):
        pair = token * top_k + j
        expert = tl.load(ids_ptr + pair)
        if (expert >= 0) & (expert < num_experts):  # else a pair no tile computed
            acc += tl.load(y_ptr + pair * H + hs, mask=h_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + hs, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


def pick_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype = torch.bfloat16,
) -> MoeConfig:
    """Tiles by the expected rows per expert, r = T * k / E (uniform routing).

    r <= 8 (decode): BLOCK_M 16 (tl.dot's least; a tile's few real rows are padded in
    registers, which costs compute, not memory), gate/up programs of 32 columns of each half and
    down programs of 64, each with K steps of 256 (8-16 KiB of weights per stage): the fastest of
    the tile sweep (bench/moe_layer.py --sweep) on an H100 for Qwen3-30B-A3B at both T = 1 and
    T = 64 (docs/benchmarks.md). Then tensor-core tiles, growing to vLLM's tuned H100 config for
    this shape at T >= 1536 (128 x 256 x 64, 8 warps, 4 stages; gate/up's 128 columns of each
    half are the same 256 accumulator columns). float32 takes half the K step: the same shared
    memory per stage.
    """
    ratio = min(top_k / max(num_experts, 1), 1.0)
    rows = num_tokens * ratio
    if rows <= 8:
        config = MoeConfig(16, GemmTiles(32, 256, 4, 3), GemmTiles(64, 256, 4, 3))
    elif rows <= 32:
        config = MoeConfig(32, GemmTiles(64, 128, 4, 3), GemmTiles(128, 128, 8, 3))
    elif rows <= 128:
        config = MoeConfig(64, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4))
    else:
        config = MoeConfig(128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4))
    wide = dtype.itemsize > 2
    gate_up = _fit(config.gate_up, inter, hidden, wide)
    return MoeConfig(config.block_m, gate_up, _fit(config.down, hidden, inter, wide))


def _fit(tiles: GemmTiles, n: int, k: int, wide: bool) -> GemmTiles:
    """No wider or deeper than the GEMM itself (small shapes); half as deep for float32."""
    block_n = min(tiles.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(tiles.block_k // (2 if wide else 1), max(16, triton.next_power_of_2(k)))
    return GemmTiles(block_n, max(16, block_k), tiles.num_warps, tiles.num_stages)


def _check_weight(
    name: str, w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
    shape: tuple[int | None, ...],
) -> None:  # fmt: skip
    """A projection in x's dtype, or FP8 (e4m3) with a float32 scale per output channel."""
    if scale is None:
        if isinstance(w, torch.Tensor) and w.dtype == FP8:
            raise ValueError(f"an FP8 {name} needs {name}_scale (one per output channel)")
        check_tensor(name, w, dtypes=(dtype,), shape=shape)
        return
    check_tensor(name, w, dtypes=(FP8,), shape=shape)
    check_tensor(f"{name}_scale", scale, dtypes=(torch.float32,), shape=tuple(w.shape[:2]))


def _check_layer(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
) -> tuple[int, int, int]:  # fmt: skip
    """(E, H, I) of a layer whose arguments all fit together; else a ValueError."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_weight("w13", w13, w13_scale, x.dtype, (None, None, None))
    num_experts, two_inter, hidden = w13.shape
    if hidden != x.shape[1] or two_inter % 2:
        raise ValueError(
            f"w13 must be [E, 2I, H] with H = x's {x.shape[1]} columns, got {tuple(w13.shape)}"
        )
    inter = two_inter // 2
    _check_weight("w2", w2, w2_scale, x.dtype, (num_experts, hidden, inter))
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), contiguous=True)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must have x's {x.shape[0]} rows, got {tuple(topk_ids.shape)}")
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, shape=tuple(topk_ids.shape),
                 contiguous=True)  # fmt: skip
    if w13_bias is not None:
        check_tensor("w13_bias", w13_bias, dtypes=(x.dtype,), shape=(num_experts, two_inter))
    if w2_bias is not None:
        check_tensor("w2_bias", w2_bias, dtypes=(x.dtype,), shape=(num_experts, hidden))
    check_devices(_gate_up_kernel, x=x, w13=w13, w2=w2, topk_ids=topk_ids,
                  topk_weights=topk_weights, w13_bias=w13_bias, w2_bias=w2_bias,
                  w13_scale=w13_scale, w2_scale=w2_scale)  # fmt: skip
    return num_experts, hidden, inter


def fused_moe(
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
    """x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_ids [T, k]
    (int32/int64), topk_weights [T, k], optional w13_bias [E, 2I] and w2_bias [E, H] -> out
    [T, H] in x's dtype: sum over j of topk_weights[t, j] * expert topk_ids[t, j]'s gated MLP
    of x[t] (see `fused_moe_ref`). With `w13_scale` [E, 2I] / `w2_scale` [E, H] (float32, one
    per output channel) that weight is float8_e4m3fn, weight-only: activations stay in x's
    dtype (the module docstring says how). `config` overrides `pick_config`; `pdl` launches
    with programmatic dependent launch where the GPU has it. No host synchronisation: safe to
    capture in a CUDA graph."""
    check_activation(activation)
    num_experts, hidden, inter = _check_layer(
        x, w13, w2, topk_ids, topk_weights, w13_bias, w2_bias, w13_scale, w2_scale
    )
    num_tokens, top_k = topk_ids.shape
    out = x.new_empty((num_tokens, hidden))
    if num_tokens == 0 or hidden == 0:
        return out
    if top_k == 0 or num_experts == 0 or inter == 0:
        return out.zero_()
    if config is None:
        config = pick_config(num_tokens, top_k, num_experts, hidden, inter, x.dtype)
    elif not isinstance(config, MoeConfig):
        raise ValueError(f"config must be a MoeConfig, got {type(config).__name__}")
    num_pairs = num_tokens * top_k
    sorted_pairs, tiles = moe_align(topk_ids, num_experts, config.block_m, pdl=pdl)
    num_tiles = tiles.shape[1]
    act = x.new_empty((num_pairs, inter))
    y = x.new_empty((num_pairs, hidden))
    pdl = use_pdl(_gate_up_kernel, x.device, pdl)
    precision = dot_precision(x.dtype)
    g, d = config.gate_up, config.down
    _gate_up_kernel[(num_tiles * triton.cdiv(inter, g.block_n),)](
        x, w13, w13 if w13_bias is None else w13_bias, w13 if w13_scale is None else w13_scale,
        sorted_pairs, tiles, act,
        num_tiles, top_k, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
        0 if w13_bias is None else w13_bias.stride(0),
        0 if w13_scale is None else w13_scale.stride(0),
        ACTIVATION=ACTIVATIONS.index(activation), HAS_BIAS=w13_bias is not None,
        HAS_SCALE=w13_scale is not None,
        BLOCK_M=config.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, PRECISION=precision,
        USE_PDL=pdl, num_warps=g.num_warps, num_stages=g.num_stages, **launch_options(pdl),
    )  # fmt: skip
    _down_kernel[(num_tiles * triton.cdiv(hidden, d.block_n),)](
        act, w2, w2 if w2_bias is None else w2_bias, w2 if w2_scale is None else w2_scale,
        sorted_pairs, tiles, topk_weights, y,
        num_tiles, hidden, inter, w2.stride(0), w2.stride(1),
        0 if w2_bias is None else w2_bias.stride(0),
        0 if w2_scale is None else w2_scale.stride(0),
        HAS_BIAS=w2_bias is not None, HAS_SCALE=w2_scale is not None,
        BLOCK_M=config.block_m, BLOCK_N=d.block_n,
        BLOCK_K=d.block_k, PRECISION=precision, USE_PDL=pdl, num_warps=d.num_warps,
        num_stages=d.num_stages, **launch_options(pdl),
    )  # fmt: skip
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, topk_ids, out, top_k, num_experts, hidden, out.stride(0),
        BLOCK_H=block_h, USE_PDL=pdl, num_warps=4, **launch_options(pdl),
    )  # fmt: skip
    return out
