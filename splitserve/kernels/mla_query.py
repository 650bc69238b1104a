"""The RoPE part of MLA's absorbed decode query, turned and written in one launch.

engine/mla.py builds the decode query [T, heads, kv_lora_rank + rope_dim] in place: W_UK's
product lands in the first kv_lora_rank columns (a strided bmm) and `rope_query` turns q_pe at
each token's position straight into the rest, in the model's layout ("half", "interleave" or
"complex", latent_write.py `turn_pairs`), where torch takes a gather of the tables, several
elementwise ops and a concatenation. Source and destination may be any views whose last
dimension is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor
from splitserve.kernels.latent_write import LAYOUTS, turn_pairs

__all__ = ["rope_query"]


@triton.jit
def _rope_query_kernel(
    q_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    stride_qt,
    stride_qh,
    stride_table,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    LAYOUT: tl.constexpr,  # 0 half, 1 interleave, 2 complex
):
    token = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    pair = j < HALF
    mask = (heads < num_heads) & pair
    pos = tl.load(positions_ptr + token).to(tl.int64)
    # The tables hold cat(freqs, freqs): entry j is pair j's angle.
    c = tl.load(cos_ptr + pos * stride_table + j, mask=pair)
    s = tl.load(sin_ptr + pos * stride_table + j, mask=pair)
    src = q_ptr + token * stride_qt + heads * stride_qh
    if LAYOUT == 0:  # halves in
        x1 = tl.load(src + j, mask=mask)
        x2 = tl.load(src + HALF + j, mask=mask)
    else:  # pairs in
        x1 = tl.load(src + 2 * j, mask=mask)
        x2 = tl.load(src + 2 * j + 1, mask=mask)
    first, second = turn_pairs(x1, x2, c, s, LAYOUT, dtype)
    dst = out_ptr + token * stride_ot + heads * stride_oh
    if LAYOUT == 2:  # pairs out
        tl.store(dst + 2 * j, first, mask=mask)
        tl.store(dst + 2 * j + 1, second, mask=mask)
    else:  # halves out
        tl.store(dst + j, first, mask=mask)
        tl.store(dst + HALF + j, second, mask=mask)


def rope_query(
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str,
    out: torch.Tensor,
) -> torch.Tensor:
    """Turn q_pe [T, heads, rope_dim] at `positions` [T] by the `cos`/`sin` tables [max_len,
    rope_dim] in `layout` (one of LAYOUTS) and write it into `out` (same shape and dtype, any
    strides with a contiguous last dimension); returns `out`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_tensor("q_pe", q_pe, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, heads, rope = q_pe.shape
    if rope % 2:
        raise ValueError(f"rope_dim must be even, got {rope}")
    check_tensor("out", out, dtypes=(q_pe.dtype,), shape=tuple(q_pe.shape))
    check_tensor("positions", positions, shape=(num_tokens,))
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, dtypes=FLOAT_DTYPES, shape=(None, rope))
    check_devices(_rope_query_kernel, q_pe=q_pe, positions=positions, cos=cos, sin=sin, out=out)
    if num_tokens == 0:
        return out
    _rope_query_kernel[(num_tokens,)](
        q_pe, positions, cos, sin, out, heads,
        q_pe.stride(0), q_pe.stride(1), cos.stride(0), out.stride(0), out.stride(1),
        HALF=rope // 2, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_HALF=max(2, triton.next_power_of_2(rope // 2)), LAYOUT=LAYOUTS.index(layout),
        num_warps=1 if heads * rope <= 1024 else 4,
    )  # fmt: skip
    return out
