"""Matrix-vector product for batch-1 decode: out[1, N] = x[1, K] @ weight[N, K]^T (+ bias).

A batch-1 decode step reads every weight once and does almost no arithmetic, so each projection
is a streaming read of `weight`. One program owns BLOCK_N output columns over the whole K (no
split-K, so no second reduce kernel), walks K in BLOCK_K tiles accumulating w * x elementwise in
float32, and sums each row once at the end. On an H200 this beats cuBLAS at M = 1 by 4-37% on
the Llama-3-8B projections and up to 4x on Qwen3-0.6B's small ones (bench/gemv.py); for more
rows the model keeps F.linear (a tensor-core variant of this kernel lost to cuBLAS at M = 8).

The K loop is software-pipelined (`tl.range(..., num_stages=3)`): a program's next weight tiles
stream into shared memory (cp.async) while it sums the current one. NOTE: with a plain `range`
Triton did not pipeline these loads, which feed no `tl.dot` (its sm_90 IR: one `ld.global` per
tile), so each tile was a round trip to memory of its own; on an H100 the FP8 Llama-3-8B
batch-1 decode step went from 3.56 to 3.42 ms with the change. Two stages were slower (3.55
ms) and four no faster (3.45 ms), so STAGES stays 3.

Each program reads its first weight tile before it waits for the previous kernel (PDL): no
kernel of a step writes weights, and a program launched early holds the tile when the wait
ends. On an H100 this took the bf16 Llama-3-8B batch-1 step from 5.69 to 5.53 ms and left the
FP8 step as it was (3.43 ms; an earlier variant that also carried the rest of the loop in
registers by hand was slower, docs/benchmarks.md section 9).

SwiGLU is fused behind the merged gate/up projection (`swiglu=True`): each program reads the
same BLOCK_N channels of the gate half and of the up half and writes silu(gate) * up, rounded as
the separate kernels/activation.py launch would round it, so that launch goes. (In front of the
down projection it lost: every program would redo it over all of K from L2, which on an H200 cost
more, 31-38 µs, than the separate launch plus a plain GEMV, ~30 µs, for the Llama-3-8B shape.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor
from splitserve.kernels.activation import silu_and_mul_ref, silu_mul
from splitserve.kernels.pdl import launch_options, pdl_launch_dependents, pdl_wait, use_pdl

__all__ = ["gemv", "gemv_ref", "pick_config"]

# Weight tiles in flight per program in the K loop (see the module docstring).
STAGES = 3


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    up_offset,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    w_rows = w_ptr + cols_n.to(tl.int64)[:, None] * stride_wn
    # The first weight tile is read before the wait: no kernel of the step writes weights, and
    # launched early (PDL), the program has it in registers when the previous kernel ends.
    ks = tl.arange(0, BLOCK_K)
    first_mask = n_mask[:, None] & (ks < K)[None, :]
    w = tl.load(w_rows + ks[None, :], mask=first_mask, other=0.0)
    w_up = tl.load(w_rows + up_offset + ks[None, :], mask=first_mask, other=0.0) if SWIGLU else w
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    acc_up = w_up.to(tl.float32) * x[None, :] if SWIGLU else tl.zeros((1, 1), dtype=tl.float32)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if SWIGLU:  # the up half's rows, `up_offset` elements (N rows) further on
            w_up = tl.load(
                w_rows + up_offset + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0
            )
            acc_up += w_up.to(tl.float32) * x[None, :]
    dtype = out_ptr.dtype.element_ty
    result = _epilogue(acc, cols_n, n_mask, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS)
    if SWIGLU:  # silu(gate) * up, each rounded to the output dtype first as two launches would
        up = _epilogue(acc_up, cols_n + N, n_mask, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS)
        result = silu_mul(result.to(dtype), up.to(dtype), dtype)
    tl.store(out_ptr + cols_n, result.to(dtype), mask=n_mask)


@triton.jit
def _epilogue(
    acc, cols, mask, scale_ptr, bias_ptr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr
):
    """The outputs `cols` (float32): each row's sum, times its FP8 scale, plus its bias."""
    result = tl.sum(acc, axis=1)
    if HAS_SCALE:  # FP8 weights: one scale per output channel
        result *= tl.load(scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        result += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return result


def pick_config(n: int, k: int, fp8: bool = False, swiglu: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a [1, k] x [n, k]^T product. With `swiglu` a program
    reads BLOCK_N rows of each half, so BLOCK_N is halved: the same bytes in flight.

    NOTE: the fastest of bench/gemv.py's sweep on an H200 for the Llama-3-8B and Qwen3-0.6B
    projections: wide outputs (gate/up, LM head) want many small programs; short, deep ones
    (o, down) fewer programs each reading long rows with more warps. FP8 weights (`--fp8
    --sweep` on an H100): 8 KiB tiles and 4 warps; 8 rows of 1 KiB for the short outputs (o,
    down: 16 rows of 2 KiB with 8 warps were 15-37% slower there), 16 of 512 B elsewhere.
    """
    block_n, block_k, num_warps = _tiles(n, k, fp8)
    return (max(block_n // 2, 1) if swiglu else block_n), block_k, num_warps


def _tiles(n: int, k: int, fp8: bool) -> tuple[int, int, int]:
    if fp8:
        if n <= 4096 and k >= 4096:
            return 8, 1024, 4
        return 16, 512, 4
    if n >= 16384:
        return 16, 256, 4
    if n <= 2048 and k >= 2048:
        return 8, 1024, 8
    if n <= 4096 and k >= 4096:
        return 16, 1024, 8
    return 8, 512, 4


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    swiglu: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """x [1, K], weight [N, K], bias [N] -> out [1, N] in x's dtype. An FP8 (e4m3) weight
    comes with `weight_scale` [N] (float32): out = (x @ weight^T) * scale + bias. `swiglu`: the
    weight is gate | up stacked, out [1, N / 2] = silu(gate) * up. `config` overrides
    `pick_config` (with `swiglu`, BLOCK_N counts the channels of each half)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    fp8 = weight_scale is not None
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float8_e4m3fn,) if fp8 else (x.dtype,))
    rows, width = x.shape
    n, k = weight.shape
    if rows != 1:
        raise ValueError(f"x must have exactly 1 row (use F.linear for more), got {rows}")
    if width != k:
        raise ValueError(f"x has {width} columns, weight {tuple(weight.shape)} needs {k}")
    if swiglu and n % 2:
        raise ValueError(f"a SwiGLU weight stacks gate | up: its {n} rows must be even")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), shape=(n,))
    if weight_scale is not None:
        check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,), shape=(n,))
    width_out = n // 2 if swiglu else n
    if out is None:
        out = x.new_empty((1, width_out))
    check_tensor("out", out, dtypes=(x.dtype,), shape=(1, width_out))
    check_devices(_gemv_kernel, x=x, weight=weight, bias=bias, weight_scale=weight_scale, out=out)
    if n == 0:
        return out
    block_n, block_k, num_warps = config or pick_config(n, k, fp8, swiglu)
    pdl = use_pdl(_gemv_kernel, x.device, pdl)
    _gemv_kernel[(triton.cdiv(width_out, block_n),)](
        x,
        weight,
        weight_scale if weight_scale is not None else x,
        bias if bias is not None else x,
        out,
        width_out,
        k,
        weight.stride(0),
        width_out * weight.stride(0),
        HAS_SCALE=fp8,
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=STAGES,
        USE_PDL=pdl,
        num_warps=num_warps,
        **launch_options(pdl),
    )
    return out


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    swiglu: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """Plain-torch `gemv`: F.linear (FP8: on the dequantized weight, in float32), then with
    `swiglu` torch's silu(gate) * up; `config` is ignored."""
    del config
    if weight_scale is None:
        result = torch.nn.functional.linear(x, weight, bias)
    else:
        w = weight.float() * weight_scale[:, None]
        b = None if bias is None else bias.float()
        result = torch.nn.functional.linear(x.float(), w, b).to(x.dtype)
    if swiglu:
        result = silu_and_mul_ref(result)
    if out is None:
        return result
    return out.copy_(result)
