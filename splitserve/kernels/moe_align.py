"""The fused MoE layer's alignment (kernels/fused_moe.py): (token, slot) pairs sorted by expert
and a tile map over them, computed on the device with no host synchronisation.

The align kernel has one program per expert: each finds the per-expert counts (a one-hot sum
over the ids when there are few pairs; else `_count_kernel` counts each expert's pairs first),
their prefix sums, writes its own tiles to the map and its pairs, in pair order, to the sorted
list. fused_moe.py's docstring draws the map and says why no expert run is padded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import check_devices, check_tensor
from splitserve.kernels.pdl import launch_options, pdl_start, use_pdl

__all__ = ["moe_align", "num_tiles_bound"]

ONE_PASS_PAIRS = 512  # up to this many pairs the align kernel counts the experts itself


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    expert = tl.program_id(0)
    hits = tl.zeros([BLOCK], dtype=tl.int32)
    for m0 in range(0, num_pairs, BLOCK):
        ms = m0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + ms, mask=ms < num_pairs, other=-1)
        hits += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(hits, axis=0))


@triton.jit
def _align_kernel(
    ids_ptr, counts_ptr, sorted_ptr, tiles_ptr,
    num_pairs, num_experts, num_tiles,
    COUNTED: tl.constexpr, TILE_M: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    expert = tl.program_id(0)
    es = tl.arange(0, E_POW2)
    if COUNTED:
        counts = tl.load(counts_ptr + es, mask=es < num_experts, other=0)
    else:
        counts = tl.zeros([E_POW2], dtype=tl.int32)
        for m0 in range(0, num_pairs, BLOCK):
            ms = m0 + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + ms, mask=ms < num_pairs, other=-1)
            counts += tl.sum((ids[:, None] == es[None, :]).to(tl.int32), axis=0)
        counts = tl.where(es < num_experts, counts, 0)
    num_expert_tiles = (counts + TILE_M - 1) // TILE_M
    mine = es == expert
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    row0 = tl.sum(tl.where(mine, tl.cumsum(counts, 0) - counts, 0), axis=0)
    n_tiles = tl.sum(tl.where(mine, num_expert_tiles, 0), axis=0)
    tile0 = tl.sum(tl.where(mine, tl.cumsum(num_expert_tiles, 0), 0), axis=0) - n_tiles
    # This expert's tiles: (expert, first row, end row) in three planes of the map.
    for j0 in range(0, n_tiles, BLOCK):
        js = j0 + tl.arange(0, BLOCK)
        jm = js < n_tiles
        first = row0 + js * TILE_M
        tl.store(tiles_ptr + tile0 + js, expert + js * 0, mask=jm)
        tl.store(tiles_ptr + num_tiles + tile0 + js, first, mask=jm)
        end = tl.minimum(first + TILE_M, row0 + count)
        tl.store(tiles_ptr + 2 * num_tiles + tile0 + js, end, mask=jm)
    if expert == 0:  # the unused tail of the map
        for t0 in range(tl.sum(num_expert_tiles, axis=0), num_tiles, BLOCK):
            ts = t0 + tl.arange(0, BLOCK)
            tl.store(tiles_ptr + ts, tl.full([BLOCK], -1, tl.int32), mask=ts < num_tiles)
    # This expert's pairs in pair order (a stable sort): the same list every run.
    if count > 0:
        seen = count * 0
        for m0 in range(0, num_pairs, BLOCK):
            ms = m0 + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + ms, mask=ms < num_pairs, other=-1)
            hit = (ids == expert).to(tl.int32)
            rank = seen + tl.cumsum(hit, 0) - 1
            tl.store(sorted_ptr + row0 + rank, ms, mask=hit > 0)
            seen += tl.sum(hit, axis=0)


def num_tiles_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most tiles `num_pairs` pairs over `num_experts` experts can make: each expert with
    pairs adds at most one partial tile to the full ones."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [T * k] int32, tiles [3, num_tiles_bound] int32).

    sorted_pairs lists the pairs p = t * k + j by expert, in pair order within an expert (its
    first `valid` entries are defined, valid = pairs with an id in [0, E)); tiles[:, i] is tile
    i's (expert, first row, end row) in that list, expert -1 for tiles past the last."""
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), contiguous=True)
    if num_experts < 1 or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(
            f"need num_experts >= 1 and block_m a power of two >= 16, got {num_experts}, {block_m}"
        )
    check_devices(_align_kernel, topk_ids=topk_ids)
    num_pairs = topk_ids.numel()
    num_tiles = num_tiles_bound(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_pairs = torch.empty(num_pairs, dtype=torch.int32, device=device)
    tiles = torch.empty((3, num_tiles), dtype=torch.int32, device=device)
    if num_pairs == 0:
        return sorted_pairs, tiles
    e_pow2 = triton.next_power_of_2(num_experts)
    counted = num_pairs > ONE_PASS_PAIRS
    pdl = use_pdl(_align_kernel, device, pdl)
    counts = tiles  # unread unless counted
    if counted:
        counts = torch.empty(num_experts, dtype=torch.int32, device=device)
        _count_kernel[(num_experts,)](
            topk_ids, counts, num_pairs, BLOCK=1024, USE_PDL=pdl, **launch_options(pdl)
        )
    _align_kernel[(num_experts,)](
        topk_ids, counts, sorted_pairs, tiles, num_pairs, num_experts, num_tiles,
        COUNTED=counted, TILE_M=block_m, E_POW2=e_pow2,
        BLOCK=1024 if counted else max(16, 4096 // e_pow2), USE_PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return sorted_pairs, tiles
