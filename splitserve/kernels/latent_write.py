"""Store this step's MLA latents into the paged latent cache at their flat slots.

    kv_cache: [1, num_blocks, block_size, 1, latent_dim] (one plane: DeepSeek's normed latent and
    its RoPE key side by side, engine/kv_cache.py `kv_page`), each page dense (pages may be
    strided: a layer's view of the block-major pool); slot = block * block_size + offset.

A negative slot means "no cache slot": padding rows of a CUDA graph replayed for a smaller batch
are skipped. Nothing is read back on the host, so the write can be captured in a decode graph
(the plain-torch reference must find the valid rows first, a device sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import check_devices, check_tensor


@triton.jit
def _write_latents_kernel(
    latents_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_slots,
    latent_dim,
    stride_lt,
    stride_cblock,
    stride_cslot,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # NOTE: slots past the pool are skipped as well as negative ones: a bad slot_mapping never
    # writes beyond the cache (the reference raises an IndexError instead).
    if (slot < 0) | (slot >= num_slots):
        return
    dims = tl.arange(0, BLOCK_D)
    mask = dims < latent_dim
    row = tl.load(latents_ptr + token * stride_lt + dims, mask=mask)
    page, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    out = cache_ptr + page * stride_cblock + offset * stride_cslot + dims
    tl.store(out, row.to(cache_ptr.dtype.element_ty), mask=mask)


def write_latents(
    latents: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `latents` ([num_tokens, latent_dim], the cache's dtype) into the layer's latent
    cache `kv_cache` ([1, num_blocks, block_size, 1, latent_dim]) at `slot_mapping`
    ([num_tokens] int64); tokens whose slot is negative are skipped."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(
            "kv_cache must be [1, num_blocks, block_size, 1, latent_dim], got "
            f"{tuple(kv_cache.shape)}"
        )
    _, num_blocks, block_size, _, latent_dim = kv_cache.shape
    if kv_cache.stride(-1) != 1 or kv_cache.stride(2) != latent_dim:
        raise ValueError("each page of kv_cache must be dense (rows of latent_dim contiguous)")
    num_tokens = latents.shape[0]
    check_tensor("latents", latents, dtypes=(kv_cache.dtype,), shape=(num_tokens, latent_dim))
    if latents.stride(-1) != 1:
        raise ValueError("latents' rows must be contiguous")
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,))
    check_devices(
        _write_latents_kernel, latents=latents, kv_cache=kv_cache, slot_mapping=slot_mapping
    )
    if num_tokens == 0:
        return
    pages = kv_cache[0]
    _write_latents_kernel[(num_tokens,)](
        latents,
        pages,
        slot_mapping,
        num_blocks * block_size,
        latent_dim,
        latents.stride(0),
        pages.stride(0),
        pages.stride(1),
        BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(latent_dim),
        num_warps=2 if latent_dim >= 256 else 1,
    )


def write_latents_ref(
    latents: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain-torch `write_latents`: an indexed copy of the rows whose slot is >= 0."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        latents, slot_mapping = latents[keep], slot_mapping[keep]
    block_size = kv_cache.shape[2]
    kv_cache[0][slot_mapping // block_size, slot_mapping % block_size, 0] = latents.to(
        kv_cache.dtype
    )
