"""Paged prefill / extend attention matches its reference: fresh prompts, chunked prefill over a
cached prefix, decode rows mixed in, several query tiles per sequence, empty sequences, MHA and
GQA, sliding windows narrower and wider than a tile, pages smaller and larger than a key tile."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.torch_attention import TorchPagedAttention
from splitserve.kernels.prefill_attention import (
    choose_num_splits,
    prefill_attention,
    prefill_attention_ref,
)
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES, random_paged_kv, tolerance

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window)
CPU_CASES = [
    ([5, 20, 1], [5, 20, 1], 4, 4, 16, 16, None),  # fresh prompts, MHA
    ([5, 20, 1], [5, 20, 1], 8, 2, 16, 16, None),  # GQA
    ([7, 16, 1, 1], [40, 16, 33, 1], 6, 2, 32, 16, None),  # cached prefixes + decode rows, group 3
    ([100, 3], [130, 3], 4, 2, 16, 16, None),  # two query tiles over a cached prefix
    ([30, 0, 12], [30, 9, 50], 4, 2, 16, 8, None),  # an empty sequence; pages < key tile
    ([40, 9], [90, 9], 4, 1, 16, 64, None),  # pages larger than the key tile
    ([70, 20], [70, 45], 4, 2, 16, 16, 7),  # window inside a tile: rows see no key of some tiles
    ([70, 20], [70, 45], 4, 2, 16, 16, 50),  # window across tiles and pages
    ([33, 1], [33, 60], 4, 2, 16, 4, 1),  # window of one key
    ([40, 1], [70, 33], 32, 8, 128, 16, None),  # the benchmark's heads and head_dim
]


def _check(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    kv_dtype: torch.dtype | None = None,
    **split: int,
) -> None:
    paged = random_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed, kv_dtype
    )
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int().to(device)
    args = (q, paged.kv_cache, paged.block_tables, cu, paged.seq_lens, max(query_lens))
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    got = prefill_attention(*args, scale, window, out=out, **split)
    assert got is out
    want = prefill_attention_ref(*args, scale, window)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(len(CPU_CASES)))
def test_prefill_matches_reference(index, dtype, device):
    _check(*CPU_CASES[index], dtype, device, seed=index)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("index", [2, 3, 4, 6, 7, 8])
def test_keys_split_across_programs_match_the_reference(index, splits, device):
    """Each tile's keys split `splits` ways (some splits empty: short contexts, windows,
    an empty sequence), the partials merged per (token, head)."""
    _check(*CPU_CASES[index], torch.float32, device, seed=index, num_splits=splits)


def test_a_small_grid_over_a_long_context_splits_its_keys():
    # one query tile of 32 heads over 32k keys on 132 SMs: 8 splits of 4k keys
    assert choose_num_splits(32, 32768, 132) == 8
    assert choose_num_splits(32, 1500, 132) == 1  # too few keys to split
    assert choose_num_splits(32 * 64, 32768, 132) == 1  # the grid fills the GPU already
    assert choose_num_splits(1, 1 << 20, 132) == 16  # at most 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", [2, 7])
def test_an_fp8_cache_matches_the_reference_on_its_values(index, dtype, device):
    """An FP8 (e4m3) cache: keys and values widen to q's dtype exactly, then attend as usual."""
    _check(*CPU_CASES[index], dtype, device, seed=index, kv_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("window", [None, 6])
def test_reference_agrees_with_the_engine_torch_backend(window, device):
    query_lens, seq_lens, heads, kv_heads, dim, block = [9, 1, 20], [25, 1, 20], 4, 2, 16, 8
    paged = random_paged_kv(seq_lens, kv_heads, dim, block, torch.float32, device, seed=3)
    q = torch.randn(sum(query_lens), heads, dim, device=device)
    cu = torch.tensor([0, 9, 10, 30], dtype=torch.int32, device=device)
    backend = TorchPagedAttention(heads, kv_heads, dim, 0.3, sliding_window=window)
    # The backend writes k, v first: hand it the cache's own query-position keys.
    slots = torch.tensor(
        [
            int(paged.block_tables[i, p // block]) * block + p % block
            for i, (n_q, n) in enumerate(zip(query_lens, seq_lens, strict=True))
            for p in range(n - n_q, n)
        ],
        device=device,
    )
    pages, offsets = slots // block, slots % block
    meta = AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=cu,
        seq_lens=paged.seq_lens,
        block_tables=paged.block_tables,
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block,
    )
    keys, values = paged.kv_cache[:, pages, offsets]
    want = backend.forward(q, keys, values, paged.kv_cache, meta)
    got = prefill_attention_ref(
        q, paged.kv_cache, paged.block_tables, cu, paged.seq_lens, 20, 0.3, window
    )
    torch.testing.assert_close(got, want)


def test_bad_arguments_raise_before_launch(device):
    paged = random_paged_kv([5, 9], 2, 16, 16, torch.float32, device, seed=0)
    q = torch.randn(14, 4, 16, device=device)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32, device=device)
    args = (paged.kv_cache, paged.block_tables)
    with pytest.raises(ValueError, match="cu_seqlens_q must have dtype"):
        prefill_attention(q, *args, cu.long(), paged.seq_lens, 9, 0.25)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        prefill_attention(q, *args, cu, paged.seq_lens[:1], 9, 0.25)
    with pytest.raises(ValueError, match="head_dim"):
        narrow = paged.kv_cache[..., :12].contiguous()
        prefill_attention(q[..., :12], narrow, paged.block_tables, cu, paged.seq_lens, 9, 0.25)
    with pytest.raises(ValueError, match="out must have dtype"):
        prefill_attention(q, *args, cu, paged.seq_lens, 9, 0.25, out=q.double())


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "window"),
    [
        ([2048], [2048], None),
        ([512, 1, 300, 1000], [4096, 700, 300, 1000], None),
        ([777, 256], [3000, 256], 1024),
    ],
)
def test_prefill_real_shapes_on_gpu(dtype, query_lens, seq_lens, window):
    _check(query_lens, seq_lens, 32, 8, 128, 16, window, dtype, torch.device("cuda"), seed=1)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "window"),
    [([64], [32832], None), ([16, 1, 64], [20000, 9000, 64], None), ([64], [32832], 4096)],
)
def test_a_short_question_after_a_long_prefix_splits_its_keys_on_gpu(
    dtype, query_lens, seq_lens, window
):
    cuda = torch.device("cuda")
    _check(query_lens, seq_lens, 32, 8, 128, 16, window, dtype, cuda, seed=2,
           max_seq_len=max(seq_lens))  # fmt: skip
