"""One key tile of paged decode attention (kernels/decode_attention.py): where its positions sit
in the cache, its keys and values, and the online-softmax update they make."""

from __future__ import annotations

import triton
import triton.language as tl

from splitserve.kernels.fp8_quant import e4m3_to_f16


@triton.jit
def cache_offsets(
    table,
    pos,
    visible,
    kv_head,
    stride_cblock,
    stride_cslot,
    stride_chead,
    BLOCK_SIZE: tl.constexpr,
):
    """Each position's offset in the cache (page = the block table's entry for it)."""
    page = tl.load(table + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
    return page * stride_cblock + (pos % BLOCK_SIZE) * stride_cslot + kv_head * stride_chead


@triton.jit
def load_kv(k_cache_ptr, v_cache_ptr, offsets, dims, mask, F16_DOTS: tl.constexpr):
    """A tile's keys (transposed: [HEAD_DIM, BLOCK_N]) and values in the cache's dtype; masked
    positions load as 0 (p == 0 there, but 0 * NaN is NaN)."""
    if F16_DOTS:  # K^T straight from memory: the dot reads 4 consecutive dims per thread
        kt = tl.load(k_cache_ptr + offsets[None, :] + dims[:, None], mask=mask[None, :], other=0.0)
    else:
        kt = tl.trans(
            tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=mask[:, None], other=0.0)
        )
    v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=mask[:, None], other=0.0)
    return kt, v


@triton.jit
def attend_tile(
    q,
    kt,
    v,
    visible,
    row_scale,
    m_i,
    l_i,
    acc,
    DOT_PRECISION: tl.constexpr,
    F16_DOTS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One tile of the online softmax: (m_i, l_i, acc) after the keys `kt` and values `v`."""
    scores = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION) * row_scale[:, None]
    scores = tl.where(visible[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if F16_DOTS and not INTERPRETED:  # noqa: SIM108 - the interpreter has no inline PTX
        v = e4m3_to_f16(v)
    else:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
