"""Paged prefill / extend attention: causal, variable length, over cached prefix + this step.

One program per (query tile of BLOCK_M tokens, sequence, query head), heaviest tiles first.
Its keys come from the paged cache, which already holds this step's keys and values (the engine
writes them first), so chunked prefill and prefix-cache hits are the same case as a fresh prompt:

    sequence i:   [ cached prefix (seq_len - query_len) | queries (query_len) ]
    query tile t:                                        |<- BLOCK_M ->|
    key tiles:    [lo ........................................ hi)
                  lo = 0, or (first query's position - window + 1) rounded down to BLOCK_N
                  hi = one past the tile's last query position (causal)

Few programs over long contexts (a short question after a long cached prefix: one query tile
per head leaves most SMs idle while each walks every key) split each tile's keys NUM_SPLITS
ways, as split-K decode does: each split leaves its normalised output and log-sum-exp, and
kernels/decode_merge.py combines them per (token, head).

Key tiles are aligned to BLOCK_N from position 0, so with power-of-two pages a tile lies inside
one page (BLOCK_N <= block_size) or covers BLOCK_N / block_size whole pages; keys are gathered
per token through the block table, which is correct for any page size. Softmax runs online in
float32, in base 2 with the scale folded in; with attention sinks (gpt-oss) each row's softmax
starts from its head's sink (kernels/attention_sinks.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import (
    check_attention,
    check_devices,
    check_tensor,
    dot_precision,
    is_interpreted,
)
from splitserve.kernels.attention_ref import prefill_attention_ref
from splitserve.kernels.attention_sinks import check_sinks, sink_state
from splitserve.kernels.decode_merge import merge_splits

__all__ = ["prefill_attention", "prefill_attention_ref"]

LOG2E = math.log2(math.e)
# Splitting: up to this many programs per SM, each split at least MIN_SPLIT_KEYS keys.
PROGRAMS_PER_SM = 2
MIN_SPLIT_KEYS = 1024
MAX_SPLITS = 16
INTERPRETER_NUM_SMS = 4


def choose_num_splits(num_programs: int, max_keys: int, num_sms: int) -> int:
    """How many ways each query tile's keys split: enough to give about PROGRAMS_PER_SM
    programs to each SM, never below MIN_SPLIT_KEYS keys a split nor above MAX_SPLITS."""
    wanted = PROGRAMS_PER_SM * num_sms // max(num_programs, 1)
    return max(1, min(wanted, max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    sinks_ptr,
    scale_log2e,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cblock,
    stride_cslot,
    stride_chead,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # The last query tiles see the most keys: launching them first shortens the grid's tail.
    tile = tl.num_programs(0) // NUM_SPLITS - 1 - tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < query_len
    q_pos = prefix_len + offs_m
    tokens = (q_start + offs_m).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )

    hi = tl.minimum(seq_len, prefix_len + (tile + 1) * BLOCK_M)
    if USE_WINDOW:
        lo = (tl.maximum(prefix_len + tile * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        lo = hi * 0

    if NUM_SPLITS > 1:  # this split's share of the key tiles
        per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)

    if HAS_SINKS:  # NOTE: in split 0's sum only, so the merge counts it once
        m_i, l_i = sink_state(sinks_ptr, head + offs_m * 0, row_mask & (offs_m * 0 + split == 0))
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + offs_n
        in_context = k_pos < seq_len
        page = tl.load(table + k_pos // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
        kv_offsets = page * stride_cblock + (k_pos % BLOCK_SIZE) * stride_cslot
        kv_offsets += kv_head * stride_chead
        k = tl.load(
            k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=in_context[:, None], other=0.0
        ).to(q.dtype)  # an FP8 cache widens here (scale 1); else a no-op
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        visible = in_context[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible &= q_pos[:, None] - k_pos[None, :] < window
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # NOTE: a row can see no key of a tile (its window starts later, or it is a padding row
        # past query_len); shifting such a row by 0 keeps exp2(-inf - -inf) = NaN out.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=in_context[:, None], other=0.0
        ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:  # partials [token, head, split]: float32, merged by merge_splits_kernel
        part = (tokens * tl.num_programs(2) + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, row_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


def _launch_config(
    dtype: torch.dtype, head_dim: int, max_query_len: int
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages).

    128 x 64 tiles with 8 warps is the usual Hopper/Ampere choice for head_dim 128 in 16-bit;
    short queries (chunk tails, small extends) get a smaller BLOCK_M so that padding rows do not
    dominate. float32 runs its dots on FMA units (exact "ieee" precision), where 32 x 32 tiles
    and 8 warps keep it from spilling registers.
    """
    block_m = min(128, max(16, triton.next_power_of_2(max_query_len)))
    if dtype == torch.float32:
        return min(block_m, 32 if head_dim <= 128 else 16), 32, 8, 2
    if head_dim > 128:
        return min(block_m, 64), 32, 4, 2
    return block_m, 64, 8 if block_m >= 128 else 4, 3 if head_dim <= 64 else 2


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query token to its sequence's paged context; returns out.

    q: [num_tokens, num_heads, head_dim], sequences end to end as `cu_seqlens_q`
    ([num_seqs + 1] int32) says; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    (each block dense, q's dtype) already holding this step's keys and values; block_tables:
    [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32, context length after this step
    (>= the sequence's query length); max_query_len: the longest query (sizes the grid).
    `sinks` (float32 [num_heads], gpt-oss): one more logit per head in each softmax's
    denominator (kernels/attention_sinks.py). `max_seq_len` (the longest context, known on the
    host) lets a small grid split its keys (`choose_num_splits`); `num_splits` forces a count.
    """
    block_size, num_kv_heads = check_attention(q, kv_cache, sliding_window)
    num_tokens, num_heads, head_dim = q.shape
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), contiguous=True)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q must hold at least one entry")
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(num_seqs,))
    check_tensor(
        "block_tables", block_tables, ndim=2, dtypes=(torch.int32,), shape=(num_seqs, None)
    )
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, dtypes=(q.dtype,), shape=tuple(q.shape))
    check_sinks(sinks, num_heads)
    check_devices(
        _prefill_kernel,
        q=q,
        kv_cache=kv_cache,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        out=out,
        sinks=sinks,
    )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_seqs == 0 or num_tokens == 0 or max_query_len == 0:
        return out

    block_m, block_n, num_warps, num_stages = _launch_config(q.dtype, head_dim, max_query_len)
    num_tiles = triton.cdiv(max_query_len, block_m)
    if num_splits is None and max_seq_len is not None:
        keys = max_seq_len if sliding_window is None else sliding_window + max_query_len
        num_sms = (
            INTERPRETER_NUM_SMS
            if is_interpreted(_prefill_kernel)
            else torch.cuda.get_device_properties(q.device).multi_processor_count
        )
        num_splits = choose_num_splits(num_tiles * num_seqs * num_heads, keys, num_sms)
    num_splits = num_splits or 1
    part_out = part_lse = out
    if num_splits > 1:  # float32 partials, summed again in the merge
        part_out = q.new_empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32)
        part_lse = q.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_tiles * num_splits, num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        seq_lens if sinks is None else sinks,  # (never read without sinks)
        scale * LOG2E,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        NUM_SPLITS=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        merge_splits(out, part_out, part_lse)
    return out
