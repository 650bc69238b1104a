"""Rotary position embedding (neox / HF "rotate_half" style) on q and k, one program per token.

    x = [x1 | x2] (halves of head_dim), rotate_half(x) = [-x2 | x1]
    out = x * cos + rotate_half(x) * sin = [x1*c1 - x2*s1 | x2*c2 + x1*s2]

cos/sin are engine/rotary.py's float32 tables [max_len, head_dim] (the halves repeat). As there,
they are cast to q's dtype first and each product and the sum round to that dtype, so 16-bit
results round where the engine's torch code does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import (
    FLOAT_DTYPES,
    check_devices,
    check_paged_cache,
    check_tensor,
)
from splitserve.kernels.fp8_quant import round_to_e4m3
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = [
    "rotary_embedding",
    "rotary_embedding_ref",
    "rotary_embedding_write_kv",
    "rotary_embedding_write_kv_ref",
]


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_src,
    stride_dst,
    num_heads,
    c1,
    c2,
    s1,
    s2,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate the [num_heads, 2 * HALF] rows of one token (pointers at its head 0). The
    arithmetic rounds in src's dtype; an FP8 dst then takes the result as `_store_rows` does."""
    dtype = src_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    src = src_ptr + heads * stride_src + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # NOTE: every load of this token happens before its stores, so dst may alias src (in place).
    o1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    dst = dst_ptr + heads * stride_dst + dims
    _store_rows(dst, o1.to(dtype), mask)
    _store_rows(dst + HALF, o2.to(dtype), mask)


@triton.jit
def _store_rows(dst, x, mask):
    """Store x at dst in dst's dtype; into an FP8 (e4m3, scale 1) cache as
    kernels/kv_cache_write.py stores: saturated to +-448, rounded to nearest even."""
    if dst.dtype.element_ty == tl.float8e4nv:
        x = round_to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0))
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    v_out_ptr,
    positions_ptr,
    slot_mapping_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    num_kv_heads,
    num_slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kob,
    stride_kot,
    stride_koh,
    stride_table,
    ROWS_PER_BLOCK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    WRITE_KV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rotate one token's q into q_out, and its k into k_out at row `token`; with WRITE_KV,
    k_out/v_out are the key/value cache planes and the row is the token's slot (its rotated k
    and its v go there). Row r lives at (r // ROWS_PER_BLOCK) * stride_kob
    + (r % ROWS_PER_BLOCK) * stride_kot: a paged plane's blocks need not be adjacent."""
    pdl_start(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    dims = tl.arange(0, HALF)[None, :]
    table = position * stride_table + dims
    # Rounded to q's dtype, then widened: the engine multiplies by `cos.to(q.dtype)`.
    c1 = tl.load(cos_ptr + table).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + table).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF).to(dtype).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        q_out_ptr + token * stride_qot,
        stride_qh,
        stride_qoh,
        num_heads,
        c1,
        c2,
        s1,
        s2,
        HALF,
        BLOCK_HQ,
    )
    if WRITE_KV:
        row = tl.load(slot_mapping_ptr + token).to(tl.int64)
        # As kernels/kv_cache_write.py: negative slots (padding) and slots past the pool are
        # skipped.
        keep = (row >= 0) & (row < num_slots)
    else:
        row = token
        keep = True
    if keep:
        row_offset = (row // ROWS_PER_BLOCK) * stride_kob + (row % ROWS_PER_BLOCK) * stride_kot
        _rotate_heads(
            k_ptr + token * stride_kt,
            k_out_ptr + row_offset,
            stride_kh,
            stride_koh,
            num_kv_heads,
            c1,
            c2,
            s1,
            s2,
            HALF,
            BLOCK_HK,
        )
        if WRITE_KV:
            heads = tl.arange(0, BLOCK_HK)[:, None]
            cols = tl.arange(0, 2 * HALF)[None, :]
            mask = heads < num_kv_heads
            v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + cols, mask=mask)
            _store_rows(v_out_ptr + row_offset + heads * stride_koh + cols, v, mask)


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    pdl: bool,
) -> None:
    """Launch over q's tokens; k_rows/v_rows are [rows, num_kv_heads, head_dim] targets, indexed
    by token, or by `slot_mapping` when given (then k_rows/v_rows are the cache planes,
    [num_blocks, block_size, num_kv_heads, head_dim], with the same strides)."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    if slot_mapping is None:  # plain rows: one row per "block"
        rows_per_block, num_rows = 1, k_rows.shape[0]
        stride_block, stride_row, stride_head = k_rows.stride(0), 0, k_rows.stride(1)
    else:
        rows_per_block, num_rows = k_rows.shape[1], k_rows.shape[0] * k_rows.shape[1]
        stride_block, stride_row, stride_head = k_rows.stride()[:3]
    pdl = use_pdl(_rotary_kernel, q.device, pdl)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        v,
        q_out,
        k_rows,
        v_rows,
        positions,
        positions if slot_mapping is None else slot_mapping,
        cos,
        sin,
        num_heads,
        num_kv_heads,
        num_rows,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        stride_block,
        stride_row,
        stride_head,
        cos.stride(0),
        ROWS_PER_BLOCK=rows_per_block,
        HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        WRITE_KV=slot_mapping is not None,
        USE_PDL=pdl,
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
        **launch_options(pdl),
    )


def _check_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[int, int, int]:
    """Validate rotary inputs; returns (num_tokens, num_heads, head_dim)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), shape=(num_tokens, None, head_dim))
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"head_dim must be twice a power of two, got {head_dim}")
    check_tensor("positions", positions, dtypes=(torch.int64,), shape=(num_tokens,))
    check_tensor("cos", cos, ndim=2, dtypes=(torch.float32,), contiguous=True)
    check_tensor("sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape), contiguous=True)
    if cos.shape[1] != head_dim:
        raise ValueError(f"cos/sin must have head_dim ({head_dim}) columns, got {cos.shape[1]}")
    return num_tokens, num_heads, head_dim


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = False,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] (same dtype) by the
    rows `positions` ([T] int64) of cos/sin ([max_len, head_dim] float32, contiguous).

    Returns (q_out, k_out): new tensors, the given `q_out`/`k_out`, or q and k themselves when
    `inplace`. Positions must be < max_len (they index the tables unchecked, as the engine's
    `cos[positions]` would on a GPU).
    """
    _check_rotary(positions, q, k, cos, sin)
    if inplace:
        if q_out is not None or k_out is not None:
            raise ValueError("pass either inplace=True or q_out/k_out, not both")
        q_out, k_out = q, k
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    check_tensor("q_out", q_out, dtypes=(q.dtype,), shape=tuple(q.shape))
    check_tensor("k_out", k_out, dtypes=(q.dtype,), shape=tuple(k.shape))
    check_devices(
        _rotary_kernel, positions=positions, q=q, k=k, cos=cos, sin=sin, q_out=q_out, k_out=k_out
    )
    _launch(positions, q, k, k, cos, sin, q_out, k_out, k_out, None, pdl)
    return q_out, k_out


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = False,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `rotary_embedding`: engine/rotary.py's RotaryEmbedding.forward."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    half = q.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

    q_rot, k_rot = rotate(q), rotate(k)
    if inplace:
        q_out, k_out = q, k
    if q_out is not None:
        q_rot = q_out.copy_(q_rot)
    if k_out is not None:
        k_rot = k_out.copy_(k_rot)
    return q_rot, k_rot


def rotary_embedding_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """`rotary_embedding` and `write_kv_cache` in one launch: returns the rotated q (in `q_out`
    or a new tensor) and writes the rotated k and v into `kv_cache` at `slot_mapping`; k itself
    is left as it was. Same arguments and rules as those two functions: the cache holds q's
    dtype or FP8 (the rotated keys round to q's dtype first, then are quantized)."""
    num_tokens, _, head_dim = _check_rotary(positions, q, k, cos, sin)
    check_tensor("v", v, dtypes=(q.dtype,), shape=tuple(k.shape))
    check_paged_cache("kv_cache", kv_cache)
    if kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_cache must have dtype {q.dtype} (q's) or FP8, got {kv_cache.dtype}")
    if tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]):
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not fit k {tuple(k.shape)}")
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,))
    q_out = torch.empty_like(q) if q_out is None else q_out
    check_tensor("q_out", q_out, dtypes=(q.dtype,), shape=tuple(q.shape))
    check_devices(
        _rotary_kernel,
        positions=positions,
        q=q,
        k=k,
        v=v,
        cos=cos,
        sin=sin,
        q_out=q_out,
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
    )
    _launch(positions, q, k, v, cos, sin, q_out, kv_cache[0], kv_cache[1], slot_mapping, pdl)
    return q_out


def rotary_embedding_write_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `rotary_embedding_write_kv`: the two references one after the other."""
    from splitserve.kernels.kv_cache_write import write_kv_cache_ref

    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos, sin, q_out=q_out)
    write_kv_cache_ref(k_rot, v, kv_cache, slot_mapping)
    return q_rot
