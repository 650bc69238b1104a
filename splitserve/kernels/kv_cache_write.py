"""Store this step's keys and values into the paged KV cache at their flat slots.

    kv_cache[0 or 1]: [num_blocks, block_size, num_kv_heads, head_dim], each block dense (the
    blocks themselves may be strided: a layer's view of the block-major pool), so that
    slot = block * block_size + offset addresses one [num_kv_heads, head_dim] row:

        token t ──slot_mapping[t]──▶ row `offset` of page `block` of kv_cache[0] (key) and [1]

A negative slot means "no cache slot": padding tokens (a CUDA graph replayed for a smaller batch)
are skipped, not written.
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
from splitserve.kernels.fp8_ref import saturate_fp8
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cblock,
    stride_cslot,
    stride_chead,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # NOTE: slots past the pool are skipped as well as negative ones, so a bad slot_mapping can
    # never scribble over memory beyond the cache (the reference raises an IndexError instead).
    if (slot < 0) | (slot >= num_slots):
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = heads[:, None] < NUM_KV_HEADS
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    page, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    cache_offsets = page * stride_cblock + offset * stride_cslot
    cache_offsets += heads[:, None] * stride_chead + dims[None, :]
    if FP8:  # saturate to e4m3's range (scale 1), round to nearest even
        k = round_to_e4m3(tl.minimum(tl.maximum(k.to(tl.float32), -448.0), 448.0))
        v = round_to_e4m3(tl.minimum(tl.maximum(v.to(tl.float32), -448.0), 448.0))
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> None:
    """Write k, v ([num_tokens, num_kv_heads, head_dim]) into `kv_cache`
    ([2, num_blocks, block_size, num_kv_heads, head_dim], their dtype or FP8 (e4m3, scale 1:
    saturated to +-448, rounded to nearest even), each block dense) at `slot_mapping`
    ([num_tokens] int64); tokens whose slot is negative are skipped."""
    check_paged_cache("kv_cache", kv_cache)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    num_tokens = k.shape[0] if isinstance(k, torch.Tensor) else 0
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    value_dtypes = (k.dtype,) if fp8 and k.dtype in FLOAT_DTYPES else (kv_cache.dtype,)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, dtypes=value_dtypes, shape=(num_tokens, num_kv_heads, head_dim))
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,))
    check_devices(_write_kv_cache_kernel, k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    pdl = use_pdl(_write_kv_cache_kernel, kv_cache.device, pdl)
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_blocks * block_size,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        FP8=fp8,
        USE_PDL=pdl,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        **launch_options(pdl),
    )


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain-torch `write_kv_cache`: an indexed copy of the tokens whose slot is >= 0 (into an
    FP8 cache: saturated to +-448, then cast)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = kv_cache.shape[2]
    pages, offsets = slots // block_size, slots % block_size
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    kv_cache[0][pages, offsets] = saturate_fp8(k[keep]) if fp8 else k[keep]
    kv_cache[1][pages, offsets] = saturate_fp8(v[keep]) if fp8 else v[keep]
