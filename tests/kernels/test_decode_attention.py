"""Paged decode attention matches its reference on every path: MHA and GQA (also a group that is
not a power of two), one and many splits (including splits left empty), sliding windows,
seq_len 0 padding rows, partial last blocks, contexts over many blocks, pages smaller and larger
than the kernel's key tile, and with each split's first tile read before the wait or not."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.torch_attention import TorchPagedAttention
from splitserve.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES, random_paged_kv, tolerance

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window, num_splits)
CPU_CASES = [
    ([1, 17, 40], 4, 4, 16, 16, None, 1),  # MHA, single split writes the output directly
    ([1, 17, 40], 8, 2, 16, 16, None, 1),  # GQA
    ([33, 5, 130], 6, 2, 32, 16, None, 1),  # group of 3: padded query rows
    ([0, 45, 0, 7], 8, 2, 16, 16, None, 1),  # seq_len 0 padding rows, one split
    ([0, 45, 0, 7], 8, 2, 16, 16, None, 3),  # ... and split
    ([300, 3], 8, 2, 16, 16, None, 4),  # many blocks, split; the short row leaves splits empty
    ([300, 64, 96], 4, 1, 16, 4, None, 5),  # pages smaller than the key tile
    ([200, 130], 4, 2, 16, 64, None, 2),  # pages larger than the key tile
    ([200, 37, 1], 8, 2, 16, 16, 1, 1),  # window of one key: only itself
    ([200, 37, 1], 8, 2, 16, 16, 50, 1),  # window starting inside a page
    ([200, 37, 1], 8, 2, 16, 16, 50, 3),  # ... split over the window only
    ([500, 90], 4, 4, 16, 8, 64, 7),  # window a multiple of the tile; more splits than tiles
    ([96, 64, 250, 0], 8, 2, 16, 16, None, None),  # the split heuristic picks
    ([130, 17], 32, 8, 128, 16, None, 2),  # the benchmark's heads and head_dim
]


def _check(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    num_splits: int | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    preload: bool | None = None,
) -> None:
    paged = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, scale, window)
    got = decode_attention(*args, out=out, num_splits=num_splits, preload=preload)
    assert got is out
    want = decode_attention_ref(*args)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    for i, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert torch.all(got[i] == 0), "a padding row must be zeros"


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(len(CPU_CASES)))
def test_decode_matches_reference(index, dtype, preload, device):
    _check(*CPU_CASES[index], dtype, device, seed=index, preload=preload)


def test_each_split_count_gives_the_same_output(device):
    seq_lens, heads, kv_heads, dim, block = [150, 77], 4, 2, 16, 16
    paged = random_paged_kv(seq_lens, kv_heads, dim, block, torch.float32, device, seed=5)
    q = torch.randn(2, heads, dim, device=device)
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, 0.25)
    one = decode_attention(*args, num_splits=1)
    for splits in (2, 5):
        torch.testing.assert_close(decode_attention(*args, num_splits=splits), one)


def test_split_heuristic_splits_small_batches_of_long_contexts():
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 64  # capped at MAX_SPLITS
    assert choose_num_splits(16, 8, 32768, num_sms=132) == 5
    assert choose_num_splits(256, 8, 32768, num_sms=132) == 1  # enough programs already
    assert choose_num_splits(1, 8, 512, num_sms=132) == 8  # at least MIN_SPLIT_LEN keys each
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1
    assert choose_num_splits(4, 8, 0, num_sms=132) == 1


def test_reference_agrees_with_the_engine_torch_backend(device):
    seq_lens, heads, kv_heads, dim, block = [20, 1, 70], 8, 2, 16, 16
    paged = random_paged_kv(seq_lens, kv_heads, dim, block, torch.float32, device, seed=7)
    q = torch.randn(3, heads, dim, device=device)
    backend = TorchPagedAttention(heads, kv_heads, dim, 0.3, sliding_window=30)
    # The backend writes k, v first: hand it the cache's own last keys so nothing changes.
    last = [(i, n - 1) for i, n in enumerate(seq_lens)]
    slots = torch.stack([paged.block_tables[i, p // block] * block + p % block for i, p in last])
    slots = slots.long()
    keys, values = paged.kv_cache[:, slots // block, slots % block]
    meta = AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=torch.arange(4, dtype=torch.int32, device=device),
        seq_lens=paged.seq_lens,
        block_tables=paged.block_tables,
        query_lens_cpu=(1, 1, 1),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block,
    )
    want = backend.forward(q, keys, values, paged.kv_cache, meta)
    got = decode_attention_ref(q, paged.kv_cache, paged.block_tables, paged.seq_lens, 0.3, 30)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"].double()}, "q must have dtype"),
        (lambda a: {**a, "kv_cache": a["kv_cache"].half()}, "kv_cache must have dtype"),
        (lambda a: {**a, "block_tables": a["block_tables"].long()}, "block_tables must have"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens must have shape"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "num_heads"),
        (lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, "unit stride"),
        (lambda a: {**a, "kv_cache": a["kv_cache"].transpose(3, 4)}, "unit stride"),
        (lambda a: {**a, "kv_cache": a["kv_cache"].transpose(2, 3)}, "each block densely"),
        (lambda a: {**a, "out": a["q"][:1]}, "out must have shape"),
        (lambda a: {**a, "sliding_window": 0}, "sliding_window"),
    ],
)
def test_bad_arguments_raise_before_launch(change, message, device):
    paged = random_paged_kv([5, 9], 2, 16, 16, torch.float32, device, seed=0)
    args = {
        "q": torch.randn(2, 4, 16, device=device),
        "kv_cache": paged.kv_cache,
        "block_tables": paged.block_tables,
        "seq_lens": paged.seq_lens,
        "scale": 0.25,
        "sliding_window": None,
        "out": None,
    }
    with pytest.raises(ValueError, match=message):
        decode_attention(**change(args))


@needs_gpu
@pytest.mark.parametrize("preload", [None, True])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    ("batch", "max_len", "window"),
    [(1, 32768, None), (7, 9000, None), (256, 2048, None), (33, 5000, 4096)],
)
def test_decode_real_shapes_on_gpu(dtype, batch, max_len, window, preload):
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    seq_lens[0] = max_len
    if batch > 2:
        seq_lens[1] = 0
    cuda = torch.device("cuda")
    _check(seq_lens, 32, 8, 128, 16, window, None, dtype, cuda, seed=batch, preload=preload)


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", [1, 4, 9])
def test_an_fp8_cache_matches_the_reference_on_its_values(index, dtype, preload, device):
    """An FP8 (e4m3) cache under queries of any dtype: the kernel widens each key and value
    exactly (every e4m3 value is one of fp16's and bf16's; 16-bit queries run their dots in
    fp16, each row scaled by a power of two) and attends as usual."""
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, splits = CPU_CASES[index]
    fp8 = torch.float8_e4m3fn
    paged = random_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, index, kv_dtype=fp8
    )
    assert paged.kv_cache.dtype == fp8
    gen = torch.Generator().manual_seed(index + 1)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, head_dim**-0.5, window)
    got = decode_attention(*args, num_splits=splits, preload=preload)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, decode_attention_ref(*args), atol=atol, rtol=rtol)


@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_an_fp8_cache_under_bf16_queries_beyond_fp16_range(num_splits):
    """bf16 queries past fp16's range (|q| up to 1e5 > 65504) over an FP8 cache: the fp16 dots
    must not overflow (each query row is scaled by a power of two first)."""
    device = torch.device("cuda")
    seq_lens = [300, 17, 1000]
    fp8 = torch.float8_e4m3fn
    paged = random_paged_kv(seq_lens, 8, 128, 16, torch.bfloat16, device, 7, kv_dtype=fp8)
    # Small keys and values keep the scores moderate, so float32 summation order stays negligible.
    cache = (paged.kv_cache.float() * 2.0**-7).to(fp8)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(seq_lens), 32, 128, generator=gen)
    q[:, ::2] *= 1e5 / q[:, ::2].abs().amax(-1, keepdim=True)  # the largest |q| is 1e5
    q = q.to(device, torch.bfloat16)
    args = (q, cache, paged.block_tables, paged.seq_lens, 128**-0.5, None)
    got = decode_attention(*args, num_splits=num_splits)
    assert torch.isfinite(got).all()
    atol, rtol = tolerance(torch.bfloat16)
    torch.testing.assert_close(got, decode_attention_ref(*args), atol=atol, rtol=rtol)
