"""Random paged KV caches for the attention kernel tests.

Every slot that holds no context token (spare blocks, the tail of a partial last block) is NaN,
so a kernel that reads past a sequence's context, or through a padding entry of its block
table, turns its output into NaN instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKV:
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, shuffled pages, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32


def random_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    kv_dtype: torch.dtype | None = None,
) -> PagedKV:
    """A cache whose pages are handed out in random order, holding random keys and values for
    each sequence's first seq_len positions and NaN everywhere else.

    It is the middle layer's view of a three-layer block-major pool (the engine's layout:
    pages `num_layers` layers apart), so a kernel that strays into a neighbouring layer reads
    NaN too. `kv_dtype` (e.g. FP8) stores the same values in another dtype (NaN stays NaN)."""
    gen = torch.Generator().manual_seed(seed)
    values_gen = torch.Generator(device=device).manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # spare pages that no table points to
    order = torch.randperm(num_blocks, generator=gen)
    width = max([*blocks_needed, 1]) + 1  # a padding column in every row
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    pool_shape = (num_blocks, 3, 2, block_size, num_kv_heads, head_dim)
    pool = torch.full(pool_shape, float("nan"), dtype=dtype, device=device)
    cache = pool[:, 1].transpose(0, 1)  # [2, num_blocks, block_size, heads, dim], strided
    used = 0
    for i, (seq_len, needed) in enumerate(zip(seq_lens, blocks_needed, strict=True)):
        pages = order[used : used + needed]
        used += needed
        tables[i, :needed] = pages.int()
        positions = torch.arange(seq_len)
        page_of = pages[positions // block_size].to(device)
        offset_of = (positions % block_size).to(device)
        values = (2, seq_len, num_kv_heads, head_dim)
        cache[:, page_of, offset_of] = torch.randn(
            values, generator=values_gen, device=device, dtype=dtype
        )
    if kv_dtype is not None:
        pool = pool.to(kv_dtype)
        cache = pool[:, 1].transpose(0, 1)
    return PagedKV(
        kv_cache=cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of a kernel against the float32 reference: float32 rounding only in float32;
    in 16-bit dtypes, the rounding of p before the PV product and of the output."""
    if dtype == torch.float32:
        return 2e-5, 2e-5
    if dtype == torch.float16:
        return 5e-3, 5e-3
    return 2e-2, 2e-2


GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# NOTE: Triton's interpreter mishandles bfloat16 (`tl.dot` multiplies the raw bits, casts from
# float32 truncate instead of rounding to nearest even), so on the CPU kernels are checked in
# float32 and float16; bfloat16 joins them on a GPU.
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if torch.cuda.is_available() else ())
