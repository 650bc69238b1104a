"""Paged decode attention: one query token per sequence, split-K (flash-decoding) over the context.

Stage 1 runs one program per (sequence, KV head, split). It loads the query rows of every query
head that shares the KV head (GQA), so each K/V tile is read once per KV head, walks its share of
the context tile by tile with an online softmax, and leaves a partial output normalised by its own
sum plus that sum's log (base 2). Stage 2 (kernels/decode_merge.py) merges the splits of each
(sequence, head). With one split, stage 1 writes the final output itself and stage 2 is skipped.
With attention sinks (gpt-oss), split 0's online softmax starts from the sink, so the merged sum
holds it exactly once.

    positions:  0 ....... window_start ................................. seq_len
    tiles:      |        |[ tile ][ tile ][ tile ][ tile ][ tile ][ tile]|
                          ^ tile_base = window_start rounded down to BLOCK_N
    splits:               |<--- split 0 --->|<--- split 1 --->|<- split 2 ->|
                          (whole tiles each; a split past the last tile is empty)

Keys are gathered token by token through the block table (page = block_tables[pos // block_size]),
so BLOCK_N need not match block_size and a window may start anywhere inside a page.

At small batches a program's work is one or two tiles, and its time is a chain of dependent
reads (length, page, keys) after the wait for the previous kernel. Of those, only the newest key
(and q) is written by a kernel of the step; the rest comes from the host's staging copies and
earlier steps. So when every program fits on the GPU at once (`preload`), each split reads its
first tile of older keys and values before the wait, and after it only q and the newest key.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
from splitserve.kernels.attention_ref import decode_attention_ref
from splitserve.kernels.attention_sinks import check_sinks, sink_state
from splitserve.kernels.decode_merge import merge_splits
from splitserve.kernels.decode_tiles import attend_tile, cache_offsets, load_kv
from splitserve.kernels.pdl import launch_options, pdl_launch_dependents, pdl_wait, use_pdl

__all__ = ["choose_num_splits", "decode_attention", "decode_attention_ref"]

LOG2E = math.log2(math.e)
FP8 = torch.float8_e4m3fn
# Each split reads at least this many keys (one 16-bit tile). A split's programs are a chain of
# dependent loads (length, page, K, V) per tile, so at batch 1 the step is fastest with one tile
# each: in the Llama-3-8B decode step on an H200, 16 one-tile splits per head beat 4 four-tile
# ones by 0.25 ms (bench/decode_roofline.py; merging more partials costs little).
MIN_SPLIT_LEN = 64
MAX_SPLITS = 64
# Programs wanted per SM: several resident programs hide the latency of the gathered loads.
PROGRAMS_PER_SM = 4
# Up to this many programs per SM, each split reads its first tile of older keys before it waits
# for the previous kernel (see the kernel). At batch 1 (Llama-3-8B, H100) the FP8 decode step
# took 3.42 -> 3.36 ms; with more programs the unpipelined first tile cost more than it hid: at
# batch 256 and 4k context (one split per head) the attention call was 1.21x slower.
PRELOAD_PROGRAMS_PER_SM = PROGRAMS_PER_SM
# The interpreter has no SMs to count: it passes for a tiny GPU, so CPU runs may split too.
INTERPRETER_NUM_SMS = 4


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2e,
    window,
    num_splits,
    stride_qb,
    stride_qh,
    stride_cblock,
    stride_cslot,
    stride_chead,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    F16_DOTS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PRELOAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # NOTE: seq_lens, the block tables and every key but each sequence's newest are written
    # before this step's kernels run (the host's staging copies, earlier steps). With PRELOAD
    # the split's first tile of them is read before the wait: launched early (PDL), the program
    # has it when the kernel that writes the newest key (rotary + cache write) ends, and only q
    # and that key are read after it.
    seq_len = tl.load(seq_lens_ptr + seq)
    window_start = tl.maximum(seq_len - window, 0) if USE_WINDOW else seq_len * 0
    tile_base = (window_start // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(seq_len - tile_base, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    lo = tile_base + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    table = block_tables_ptr + seq * stride_bt
    if PRELOAD:
        pos = lo + offs_n
        visible = (pos >= window_start) & (pos < hi)
        older = visible & (pos < seq_len - 1)
        kv_offsets = cache_offsets(
            table, pos, visible, kv_head, stride_cblock, stride_cslot, stride_chead, BLOCK_SIZE
        )
        kt, v = load_kv(k_cache_ptr, v_cache_ptr, kv_offsets, dims, older, F16_DOTS)
    pdl_wait(USE_PDL)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP  # BLOCK_H >= 16 for tl.dot; rows past the group are padding
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    if F16_DOTS:
        # An FP8 cache under 16-bit queries: e4m3 widens to fp16 in one instruction per pair
        # (to bf16 it takes several), so the dots run in fp16. Each query row is first scaled
        # by a power of two that puts its largest |q| in [2^13, 2^14]: fp16 then holds every
        # bf16 value of the row to within fp16's (finer) mantissa, with no overflow, and the
        # scores are scaled back by the same power of two.
        q_max = tl.max(tl.abs(q.to(tl.float32)), 1)
        q_shift = tl.exp2(14.0 - tl.ceil(tl.log2(tl.maximum(q_max, 1e-30))))
        q = (q.to(tl.float32) * q_shift[:, None]).to(tl.float16)
        row_scale = scale_log2e / q_shift
    else:
        row_scale = tl.full([BLOCK_H], scale_log2e, tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if HAS_SINKS:  # noqa: SIM102 - a constexpr branch, then a run-time one
        # NOTE: split 0 alone starts from the sink, so the merge, which adds the splits' sums,
        # counts it once; its partial then always has a positive sum (zeros without keys).
        if split == 0:
            m_i, l_i = sink_state(sinks_ptr, heads, row_mask)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    # NOTE: every tile in [lo, hi) holds at least one visible key (window_start itself, or the
    # tile's first position), so the running max is finite after the first tile (before it,
    # with a sink) and the rescaling below never computes -inf - -inf. An empty split
    # (lo >= hi) skips them all.
    first = lo
    if PRELOAD:  # the first tile, with the newest key
        if lo < hi:
            newest = visible & (pos == seq_len - 1)
            kt_new, v_new = load_kv(k_cache_ptr, v_cache_ptr, kv_offsets, dims, newest, F16_DOTS)
            kt = tl.where(newest[None, :], kt_new, kt)  # keys are transposed: [D, BLOCK_N]
            v = tl.where(newest[:, None], v_new, v)
            m_i, l_i, acc = attend_tile(
                q, kt, v, visible, row_scale, m_i, l_i, acc, DOT_PRECISION, F16_DOTS, INTERPRETED
            )
        first = lo + BLOCK_N
    for start in range(first, hi, BLOCK_N):
        pos = start + offs_n
        visible = (pos >= window_start) & (pos < seq_len)
        kv_offsets = cache_offsets(
            table, pos, visible, kv_head, stride_cblock, stride_cslot, stride_chead, BLOCK_SIZE
        )
        kt, v = load_kv(k_cache_ptr, v_cache_ptr, kv_offsets, dims, visible, F16_DOTS)
        m_i, l_i, acc = attend_tile(
            q, kt, v, visible, row_scale, m_i, l_i, acc, DOT_PRECISION, F16_DOTS, INTERPRETED
        )

    pdl_launch_dependents(USE_PDL)
    # An empty split (or a seq_len == 0 padding row) has l_i == 0, or only the sink's weight:
    # it writes zeros, not NaN.
    has_keys = l_i > 0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        part = seq * stride_pb + heads * stride_ph + split  # [B, H, num_splits] row index
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, row_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many splits of the context each (sequence, KV head) gets.

    Without splitting there are batch * num_kv_heads programs; a small batch leaves most SMs
    idle, so split until there are about PROGRAMS_PER_SM programs per SM, but never below
    MIN_SPLIT_LEN keys per split nor above MAX_SPLITS.
    """
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(batch * num_kv_heads, 1))
    longest = max(max_seq_len // MIN_SPLIT_LEN, 1)
    return max(1, min(wanted, longest, MAX_SPLITS))


class LaunchConfig(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int
    f16_dots: bool = False  # an FP8 cache under 16-bit queries: dots in fp16 (see the kernel)


def _launch_config(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> LaunchConfig:
    """The tiles for queries of `dtype` over a cache of `cache_dtype`.

    16-bit: 64-key tiles, 4 warps, K/V loads double-buffered (cp.async); about 80 registers and
    38 KiB of shared memory per program on sm_90 for head_dim 128, so several programs fit on
    an SM. float32 runs its dots on FMA units (exact "ieee" precision): half the tile and twice
    the warps keep it from spilling registers. An FP8 cache: 64-key tiles double-buffered,
    dots in fp16, values widened before the dot's layout change (`e4m3_to_f16`). On an H100
    (Llama-3-8B heads, batch 8-256, 1k-4k context, bench/fp8_kv_attention.py) these were the
    fastest of the sweep at every size, 0-7% ahead of 128-key tiles three deep, and the FP8
    cache read 1.37-1.78x faster than the same context in bf16.
    """
    if dtype == torch.float32:
        return LaunchConfig(32, 8, 2)
    if cache_dtype == FP8:
        return LaunchConfig(64, 4, 2, f16_dots=True)
    return LaunchConfig(64, 4, 2)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    preload: bool | None = None,
    pdl: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend each sequence's single query to its paged context; returns out [B, H, D].

    q: [B, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    (each block dense, q's dtype); block_tables: [B, max_blocks] int32; seq_lens: [B] int32, the
    context length including this step's token (0 marks a padding row: its output is zeros).
    The query sits at position seq_len - 1 and, with `sliding_window`, sees keys at positions
    > seq_len - 1 - sliding_window. `max_seq_len` (an upper bound, default the block tables'
    capacity, so no device sync) and `num_splits` (default `choose_num_splits`) set the split.
    `preload` (default: with PDL, when every program fits on the GPU at once,
    PRELOAD_PROGRAMS_PER_SM per SM) reads each split's first tile of older keys before waiting
    for the previous kernel. `sinks` (float32 [num_heads], gpt-oss): one more logit per head in
    each softmax's denominator (kernels/attention_sinks.py); padding rows stay zeros.
    """
    block_size, num_kv_heads = check_attention(q, kv_cache, sliding_window)
    batch, num_heads, head_dim = q.shape
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), shape=(batch, None))
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(batch,))
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, dtypes=(q.dtype,), shape=tuple(q.shape))
    check_sinks(sinks, num_heads)
    device = check_devices(
        _decode_split_kernel,
        q=q,
        kv_cache=kv_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        out=out,
        sinks=sinks,
    )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if batch == 0:
        return out

    if is_interpreted(_decode_split_kernel):
        num_sms = INTERPRETER_NUM_SMS
    else:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = block_tables.shape[1] * block_size
        if sliding_window is not None:
            max_seq_len = min(max_seq_len, sliding_window)
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, num_sms)

    group = num_heads // num_kv_heads
    config = LaunchConfig(*_launch_config(q.dtype, kv_cache.dtype))  # (a bench passes tuples)
    single = num_splits == 1
    part_shape = (batch, num_heads, num_splits)
    # Partials are float32 whatever q's dtype: they are summed again in the merge.
    part_out = out if single else q.new_empty((*part_shape, head_dim), dtype=torch.float32)
    part_lse = out if single else q.new_empty(part_shape, dtype=torch.float32)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    pdl = use_pdl(_decode_split_kernel, device, pdl)
    if preload is None:  # (without PDL nothing runs before the wait: no gain)
        preload = pdl and batch * num_kv_heads * num_splits <= PRELOAD_PROGRAMS_PER_SM * num_sms
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        seq_lens if sinks is None else sinks,  # (never read without sinks)
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        sliding_window or 0,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads * num_splits,
        num_splits,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        USE_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        SINGLE_SPLIT=single,
        DOT_PRECISION=dot_precision(q.dtype),
        F16_DOTS=config.f16_dots and q.dtype != torch.float32 and kv_cache.dtype == FP8,
        INTERPRETED=is_interpreted(_decode_split_kernel),
        PRELOAD=preload,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    if not single:
        merge_splits(out, part_out, part_lse, pdl)
    return out
