"""Store this step's MLA latents into the paged latent cache at their flat slots.

    kv_cache: [1, num_blocks, block_size, 1, latent_dim] (one plane: DeepSeek's normed latent and
    its RoPE key side by side, engine/kv_cache.py `kv_page`), each page dense (pages may be
    strided: a layer's view of the block-major pool); slot = block * block_size + offset.

A negative slot means "no cache slot": padding rows of a CUDA graph replayed for a smaller batch
are skipped. Nothing is read back on the host, so the write can be captured in a decode graph
(the plain-torch reference must find the valid rows first, a device sync).

`write_latents_normed` does the whole of a layer's cache input in one launch: from
`kv_a_proj_with_mqa`'s output row [latent | RoPE key] it RMS-normalises the latent (float32,
cast back, times the weight: HF's order), turns the RoPE key at the token's position in the
model's layout (engine/mla.py `rotate`: "half", "interleave" or "complex") and stores both,
where torch takes a copy, the norm, several RoPE ops, a concatenation and the write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import FLOAT_DTYPES, check_devices, check_tensor


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


LAYOUTS = ("half", "interleave", "complex")


@triton.jit
def turn_pairs(x1, x2, c, s, LAYOUT: tl.constexpr, dtype: tl.constexpr):
    """RoPE on pairs (x1, x2) by angles with cosines c and sines s (float32), as engine/mla.py
    `rotate` rounds: "complex" (2) in float32, the others with the tables cast to `dtype` first
    and each product rounded. Returns the two outputs in `dtype`."""
    if LAYOUT == 2:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        return (x1f * c - x2f * s).to(dtype), (x1f * s + x2f * c).to(dtype)
    cd, sd = c.to(dtype), s.to(dtype)
    first = (x1 * cd).to(dtype) - (x2 * sd).to(dtype)
    second = (x2 * cd).to(dtype) + (x1 * sd).to(dtype)
    return first.to(dtype), second.to(dtype)


@triton.jit
def _normed_kernel(
    kv_a_ptr,
    weight_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_slots,
    eps,
    stride_at,
    stride_table,
    stride_cblock,
    stride_cslot,
    RANK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    LAYOUT: tl.constexpr,  # 0 half, 1 interleave, 2 complex
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    dtype = cache_ptr.dtype.element_ty
    row = kv_a_ptr + token * stride_at
    out = cache_ptr + (slot // BLOCK_SIZE) * stride_cblock + (slot % BLOCK_SIZE) * stride_cslot
    dims = tl.arange(0, BLOCK_R)
    live = dims < RANK
    x = tl.load(row + dims, mask=live, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / RANK + eps)
    w = tl.load(weight_ptr + dims, mask=live)
    tl.store(out + dims, (w * (x * inv).to(dtype)).to(dtype), mask=live)
    j = tl.arange(0, BLOCK_HALF)
    pair = j < HALF
    pos = tl.load(positions_ptr + token).to(tl.int64)
    # The tables hold cat(freqs, freqs): entry j is pair j's angle.
    c = tl.load(cos_ptr + pos * stride_table + j, mask=pair)
    s = tl.load(sin_ptr + pos * stride_table + j, mask=pair)
    rope = row + RANK
    if LAYOUT == 0:  # halves in, halves out
        x1 = tl.load(rope + j, mask=pair)
        x2 = tl.load(rope + HALF + j, mask=pair)
    else:  # pairs (x0, x1), (x2, x3)... in
        x1 = tl.load(rope + 2 * j, mask=pair)
        x2 = tl.load(rope + 2 * j + 1, mask=pair)
    first, second = turn_pairs(x1, x2, c, s, LAYOUT, dtype)
    if LAYOUT == 2:  # pairs kept interleaved
        tl.store(out + RANK + 2 * j, first, mask=pair)
        tl.store(out + RANK + 2 * j + 1, second, mask=pair)
    else:  # halves out
        tl.store(out + RANK + j, first, mask=pair)
        tl.store(out + RANK + HALF + j, second, mask=pair)


def write_latents_normed(
    kv_a: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Normalise and turn `kv_a` ([num_tokens, rank + rope_dim], the cache's dtype, rows
    contiguous: [latent | RoPE key]) and write it into the layer's latent cache at
    `slot_mapping`: the latent RMS-normed with `weight` [rank] and `eps`, the key turned at
    `positions` [num_tokens] by the `cos`/`sin` tables [max_len, rope_dim] in `layout`
    (one of LAYOUTS). Negative slots are skipped."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(
            "kv_cache must be [1, num_blocks, block_size, 1, latent_dim], got "
            f"{tuple(kv_cache.shape)}"
        )
    _, num_blocks, block_size, _, latent_dim = kv_cache.shape
    rank, rope = weight.shape[0], cos.shape[-1]
    if rank + rope != latent_dim or rope % 2:
        raise ValueError(f"rank {rank} + rope_dim {rope} (even) must make the row {latent_dim}")
    num_tokens = kv_a.shape[0]
    check_tensor("kv_a", kv_a, dtypes=(kv_cache.dtype,), shape=(num_tokens, latent_dim))
    check_tensor("weight", weight, dtypes=(kv_cache.dtype,), shape=(rank,))
    check_tensor("positions", positions, shape=(num_tokens,))
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, dtypes=FLOAT_DTYPES, shape=(None, rope))
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,))
    if kv_a.stride(-1) != 1 or kv_cache.stride(-1) != 1 or kv_cache.stride(2) != latent_dim:
        raise ValueError("kv_a's rows and each page of kv_cache must be dense")
    check_devices(
        _normed_kernel, kv_a=kv_a, weight=weight, positions=positions, cos=cos, sin=sin,
        kv_cache=kv_cache, slot_mapping=slot_mapping,
    )  # fmt: skip
    if num_tokens == 0:
        return
    pages = kv_cache[0]
    _normed_kernel[(num_tokens,)](
        kv_a, weight, positions, cos, sin, pages, slot_mapping, num_blocks * block_size, eps,
        kv_a.stride(0), cos.stride(0), pages.stride(0), pages.stride(1),
        RANK=rank, HALF=rope // 2, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_HALF=max(2, triton.next_power_of_2(rope // 2)), LAYOUT=LAYOUTS.index(layout),
        BLOCK_SIZE=block_size, num_warps=4 if rank >= 256 else 1,
    )  # fmt: skip
