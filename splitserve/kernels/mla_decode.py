"""Paged decode attention over MLA latents (DeepSeek-V2/V3), the weights absorbed: one query
token per sequence, split-K over the context, and its plain-torch reference.

With W_UK folded into the query and W_UV into the output (engine/mla.py), every head attends to
the same cached rows, [normed latent (kv_lora_rank) | roped key (rope_dim)]: multi-query
attention of one shared head of width kv_lora_rank + rope_dim whose value is the row's first
kv_lora_rank entries. So a program takes a block of BLOCK_H heads of one sequence (the M side of
each `tl.dot`) and reads each latent row once for all of them: the latent tile [BLOCK_N,
BLOCK_R] serves as keys (scores = q_latent . c + q_pe . k_pe, two dots) and as values (p @ c).
The latent dim is tiled in two, the latent and the RoPE part, each padded to a power of two
(at least 16, `tl.dot`'s least) and masked, so DeepSeek's 512 + 64 and small test widths alike
run; the accumulator [BLOCK_H, BLOCK_R] stays in float32, as does the online softmax.

Splits are whole tiles of the context, as in kernels/decode_attention.py; each leaves its
partial output normalised by its own sum and that sum's log (base 2), merged by
kernels/decode_merge.py. With one split the kernel writes the output itself.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import (
    FLOAT_DTYPES,
    check_devices,
    check_tensor,
    dot_precision,
    is_interpreted,
)
from splitserve.kernels.decode_attention import INTERPRETER_NUM_SMS, choose_num_splits
from splitserve.kernels.decode_merge import merge_splits
from splitserve.kernels.mla_decode_transposed import mla_decode_kernel_t

__all__ = ["LaunchConfig", "mla_decode", "mla_decode_ref"]

LOG2E = math.log2(math.e)
# Heads per program: `tl.dot` needs 16 rows; more would hold a [BLOCK_H, 512] float32
# accumulator per program in registers that DeepSeek's latent cannot spare.
BLOCK_H = 16


@triton.jit
def _mla_decode_kernel(
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
    # Masks over the dims only where a part is padded (constexpr), so whole rows load as vectors.
    r_mask = (dims_r < RANK)[None, :] if BLOCK_R != RANK else tl.full((1, BLOCK_R), 1, tl.int1)
    p_mask = (dims_p < ROPE)[None, :] if BLOCK_P != ROPE else tl.full((1, BLOCK_P), 1, tl.int1)
    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_rows + dims_r[None, :], mask=head_mask[:, None] & r_mask, other=0.0)
    q_pe = tl.load(q_rows + RANK + dims_p[None, :], mask=head_mask[:, None] & p_mask, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    # NOTE: every tile in [lo, hi) holds a visible key (its first position), so the running max
    # is finite after the first tile; an empty split (lo >= hi) runs none.
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        visible = pos < seq_len
        page = tl.load(table + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_cblock + (pos % BLOCK_SIZE) * stride_cslot
        # Masked rows load as 0 (p == 0 there, but 0 * NaN is NaN).
        c = tl.load(rows[:, None] + dims_r[None, :], mask=visible[:, None] & r_mask, other=0.0)
        pe = tl.load(
            rows[:, None] + RANK + dims_p[None, :], mask=visible[:, None] & p_mask, other=0.0
        )
        scores = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        scores = tl.where(visible[None, :], scores * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (or a seq_len == 0 padding row) has l_i == 0: it writes zeros, not NaN.
    has_keys = l_i > 0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims_r[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & r_mask)
    else:
        part = seq * stride_pb + heads * stride_ph + split  # [B, H, num_splits] row index
        part_ptrs = part_out_ptr + part[:, None] * BLOCK_R + dims_r[None, :]
        tl.store(part_ptrs, acc, mask=head_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_mask)


class LaunchConfig(NamedTuple):
    """Rows a tile, warps, pipeline stages, and which kernel: the heads on the dots' M side
    (`_mla_decode_kernel`) or the context rows (`transposed`, `mla_decode_transposed.py`)."""

    block_n: int
    num_warps: int
    num_stages: int
    transposed: bool = False


def _launch_config(dtype: torch.dtype) -> LaunchConfig:
    """16-row latent tiles under the [16, 512] float32 accumulator. Compiled for sm_90 with
    DeepSeek's 512 + 64 in bf16: 4 warps take 198 registers and no spills (two programs an SM);
    32-row tiles spill at 4 warps and fit one program an SM at 8, the same rows in flight.
    float32 (dots on FMA units, exact) takes 8 warps: 127 registers. Not yet timed on a GPU."""
    if dtype == torch.float32:
        return LaunchConfig(16, 8, 1)
    return LaunchConfig(16, 4, 2)


def _check_cache(kv_cache: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    """The layer's latent cache [1, num_blocks, block_size, 1, latent_dim], each block's rows
    dense, q's dtype; returns (block_size, latent_dim)."""
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=(dtype,))
    one, _, block_size, heads, latent_dim = kv_cache.shape
    if one != 1 or heads != 1:
        raise ValueError(
            f"kv_cache must be [1, num_blocks, block_size, 1, latent_dim], got "
            f"{tuple(kv_cache.shape)}"
        )
    if block_size > 1 and kv_cache.stride(2) != latent_dim:
        raise ValueError(f"kv_cache must hold each block densely, got strides {kv_cache.stride()}")
    return block_size, latent_dim


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """Each sequence's single query, every head, over its cached latents; returns the latent
    output out [B, num_heads, kv_lora_rank].

    q: [B, num_heads, latent_dim], each head's [q_nope @ W_UK | roped q_pe]; kv_cache: the
    layer's [1, num_blocks, block_size, 1, latent_dim] rows [latent | roped key] (q's dtype);
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32, the context length including this
    step's token (0 marks a padding row: its output is zeros). `max_seq_len` (an upper bound,
    default the block tables' capacity, so no device sync) and `num_splits` (default
    `choose_num_splits`, head blocks counted as KV heads) set the split; `launch` overrides
    the tile and kernel choice (the benchmark's sweep).
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    block_size, latent_dim = _check_cache(kv_cache, q.dtype)
    batch, num_heads, q_dim = q.shape
    rope = latent_dim - kv_lora_rank
    if q_dim != latent_dim or kv_lora_rank < 1 or rope < 1:
        raise ValueError(
            f"q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)} and kv_lora_rank "
            f"{kv_lora_rank} do not fit: latent_dim = kv_lora_rank + rope_dim"
        )
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), shape=(batch, None))
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(batch,))
    if out is None:
        out = q.new_empty(batch, num_heads, kv_lora_rank)
    check_tensor("out", out, dtypes=(q.dtype,), shape=(batch, num_heads, kv_lora_rank))
    device = check_devices(
        _mla_decode_kernel, q=q, kv_cache=kv_cache, block_tables=block_tables,
        seq_lens=seq_lens, out=out,
    )  # fmt: skip
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if batch == 0:
        return out

    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    if num_splits is None:
        if is_interpreted(_mla_decode_kernel):
            num_sms = INTERPRETER_NUM_SMS
        else:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        if max_seq_len is None:
            max_seq_len = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, head_blocks, max_seq_len, num_sms)
    block_r = max(16, triton.next_power_of_2(kv_lora_rank))
    single = num_splits == 1
    part_shape = (batch, num_heads, num_splits)
    # Partials are float32 whatever q's dtype, each row padded to BLOCK_R (the merge's width).
    part_out = out if single else q.new_empty((*part_shape, block_r), dtype=torch.float32)
    part_lse = out if single else q.new_empty(part_shape, dtype=torch.float32)
    config = launch or _launch_config(q.dtype)
    cache = kv_cache[0]
    kernel = mla_decode_kernel_t if config.transposed else _mla_decode_kernel
    kernel[(batch, head_blocks, num_splits)](
        q,
        cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        num_heads,
        num_splits,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads * num_splits,
        num_splits,
        RANK=kv_lora_rank,
        ROPE=rope,
        BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=BLOCK_H,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        SINGLE_SPLIT=single,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not single:
        if block_r == kv_lora_rank:
            merge_splits(out, part_out, part_lse)
        else:  # the merge tiles whole powers of two: merge the padded rows, keep the latent
            padded = q.new_empty(part_out.shape[:2] + (block_r,))
            merge_splits(padded, part_out, part_lse)
            out.copy_(padded[..., :kv_lora_rank])
    return out


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """`mla_decode` in plain torch, float32 math throughout: per sequence, its latent rows
    through the block table, scores = q . row * scale, softmax, weights @ rows[:, :kv_lora_rank].
    The kernel's tuning keywords are taken and ignored."""
    del max_seq_len, num_splits, launch
    batch, num_heads, _ = q.shape
    if out is None:
        out = q.new_empty(batch, num_heads, kv_lora_rank)
    block_size = kv_cache.shape[2]
    pages = kv_cache[0]
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[i] = 0
            continue
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        rows = pages[blocks].reshape(-1, pages.shape[-1])[:seq_len].float()
        probs = (q[i].float() @ rows.T * scale).softmax(dim=-1)
        out[i] = (probs @ rows[:, :kv_lora_rank]).to(out.dtype)
    return out
