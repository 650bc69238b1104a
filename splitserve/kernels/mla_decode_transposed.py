"""The absorbed MLA decode kernel with the context rows on the dots' M side (kernels/mla_decode.py
runs it for `LaunchConfig(transposed=True)`; its launch, checks and merge are that file's).

With 16 heads on the M side each score dot is [16, 576] x [576, BLOCK_N]: few MMA tiles for a
program's warps to share. Transposed, scores^T = c . q^T is [BLOCK_N, 16] and the output's
update c^T . p^T is [kv_lora_rank, 16], so 64-row context tiles give both dots a warp group's
rows whatever the head count. Same splits, masks, online softmax and partial outputs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_decode_kernel_t(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2e,
    num_heads,
    num_splits,
    stride_qb,
    stride_qh,
    stride_cblock,
    stride_cslot,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Scores^T [BLOCK_N, BLOCK_H] and the output^T [BLOCK_R, BLOCK_H]: q on the N side."""
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    dims_r = tl.arange(0, BLOCK_R)
    dims_p = tl.arange(0, BLOCK_P)
    r_mask = (dims_r < RANK)[None, :] if BLOCK_R != RANK else tl.full((1, BLOCK_R), 1, tl.int1)
    p_mask = (dims_p < ROPE)[None, :] if BLOCK_P != ROPE else tl.full((1, BLOCK_P), 1, tl.int1)
    q_cols = q_ptr + seq * stride_qb + heads[None, :] * stride_qh
    q_c = tl.load(q_cols + dims_r[:, None], mask=head_mask[None, :] & tl.trans(r_mask), other=0.0)
    q_pe = tl.load(
        q_cols + RANK + dims_p[:, None], mask=head_mask[None, :] & tl.trans(p_mask), other=0.0
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        visible = pos < seq_len
        page = tl.load(table + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_cblock + (pos % BLOCK_SIZE) * stride_cslot
        c = tl.load(rows[:, None] + dims_r[None, :], mask=visible[:, None] & r_mask, other=0.0)
        pe = tl.load(
            rows[:, None] + RANK + dims_p[None, :], mask=visible[:, None] & p_mask, other=0.0
        )
        scores = tl.dot(c, q_c, input_precision=DOT_PRECISION)
        scores += tl.dot(pe, q_pe, input_precision=DOT_PRECISION)
        scores = tl.where(visible[:, None], scores * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp2(scores - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(
            tl.trans(c), p.to(c.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    has_keys = l_i > 0
    acc = acc / tl.where(has_keys, l_i, 1.0)[None, :]
    if SINGLE_SPLIT:
        out_ptrs = out_ptr + seq * stride_ob + heads[None, :] * stride_oh + dims_r[:, None]
        mask = head_mask[None, :] & tl.trans(r_mask)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = seq * stride_pb + heads * stride_ph + split
        part_ptrs = part_out_ptr + part[None, :] * BLOCK_R + dims_r[:, None]
        tl.store(part_ptrs, acc, mask=head_mask[None, :])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_mask)
