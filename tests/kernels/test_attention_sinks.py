"""Attention sinks (gpt-oss): one learned logit per query head in every softmax's denominator.

The Triton decode and prefill kernels match the reference with sinks, with and without sliding
windows, MHA and GQA, one split and many (the sink counted once however the context is split,
padding rows still zeros); the torch backend with sinks is HF's eager gpt-oss attention on the
same q, k, v; and the Triton backend passes a layer's sinks to its kernels.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.model_config import RopeConfig
from splitserve.engine.ops import TritonOps
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.engine.torch_attention import TorchPagedAttention, gather_context
from splitserve.engine.triton_attention import TritonPagedAttention
from splitserve.kernels.decode_attention import decode_attention, decode_attention_ref
from splitserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from tests.kernels.paged_inputs import DTYPES, GPU_DTYPES, random_paged_kv, tolerance

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window, num_splits)
DECODE_CASES = [
    ([1, 17, 40], 4, 4, 16, 16, None, 1),  # MHA, one split
    ([1, 17, 40], 8, 2, 16, 16, None, 1),  # GQA
    ([0, 45, 0, 7], 8, 2, 16, 16, None, 3),  # padding rows, split
    ([300, 3], 8, 2, 16, 16, None, 4),  # the short row leaves splits empty
    ([200, 37, 1], 8, 2, 16, 16, 1, 1),  # window of one key
    ([200, 37, 1], 8, 2, 16, 16, 50, 3),  # window inside a page, split
    ([500, 90], 4, 4, 16, 8, 64, 7),  # more splits than the window's tiles
    ([150, 20], 64, 8, 64, 16, 128, 2),  # gpt-oss heads and its sliding layers' window
]

# (query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window)
PREFILL_CASES = [
    ([5, 20, 1], [5, 20, 1], 4, 4, 16, 16, None),  # fresh prompts, MHA
    ([7, 16, 1, 1], [40, 16, 33, 1], 6, 2, 32, 16, None),  # cached prefixes + decodes, group 3
    ([100, 3], [130, 3], 4, 2, 16, 16, None),  # two query tiles over a cached prefix
    ([70, 20], [70, 45], 4, 2, 16, 16, 7),  # rows that see no key of some tiles
    ([33, 1], [33, 60], 4, 2, 16, 4, 1),  # window of one key
    ([40, 1], [150, 20], 64, 8, 64, 16, 128),  # gpt-oss heads and window
]


def _sinks(num_heads: int, seed: int, device: torch.device) -> torch.Tensor:
    """Logits of the scores' size and larger, so the sink's weight shows in every output."""
    gen = torch.Generator().manual_seed(seed + 100)
    return (torch.randn(num_heads, generator=gen) * 2 + 3).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(len(DECODE_CASES)))
def test_decode_with_sinks_matches_reference(index, dtype, device):
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, splits = DECODE_CASES[index]
    paged = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, index)
    gen = torch.Generator().manual_seed(index + 1)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    sinks = _sinks(num_heads, index, device)
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, head_dim**-0.5, window)
    got = decode_attention(*args, num_splits=splits, sinks=sinks)
    want = decode_attention_ref(*args, sinks=sinks)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert not torch.allclose(want, decode_attention_ref(*args), atol=atol, rtol=rtol)
    for i, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert torch.all(got[i] == 0), "a padding row must be zeros"


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("window", [None, 40])
def test_the_sink_counts_once_however_the_context_is_split(window, preload, device):
    seq_lens, heads, kv_heads, dim, block = [150, 77, 0], 4, 2, 16, 16
    paged = random_paged_kv(seq_lens, kv_heads, dim, block, torch.float32, device, seed=5)
    q = torch.randn(3, heads, dim, device=device)
    sinks = _sinks(heads, 5, device)
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, 0.25, window)
    one = decode_attention(*args, num_splits=1, sinks=sinks, preload=preload)
    torch.testing.assert_close(one, decode_attention_ref(*args, sinks=sinks))
    for splits in (2, 5):
        split = decode_attention(*args, num_splits=splits, sinks=sinks, preload=preload)
        torch.testing.assert_close(split, one)


def test_a_sink_of_minus_infinity_is_no_sink(device):
    paged = random_paged_kv([60, 9], 2, 16, 16, torch.float32, device, seed=2)
    q = torch.randn(2, 4, 16, device=device)
    none = torch.full((4,), float("-inf"), device=device)
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, 0.25)
    for splits in (1, 3):
        want = decode_attention(*args, num_splits=splits)
        torch.testing.assert_close(decode_attention(*args, num_splits=splits, sinks=none), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(len(PREFILL_CASES)))
def test_prefill_with_sinks_matches_reference(index, dtype, device):
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block, window = PREFILL_CASES[index]
    paged = random_paged_kv(seq_lens, num_kv_heads, head_dim, block, dtype, device, index)
    gen = torch.Generator().manual_seed(index + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int().to(device)
    sinks = _sinks(num_heads, index, device)
    args = (q, paged.kv_cache, paged.block_tables, cu, paged.seq_lens, max(query_lens))
    scale = head_dim**-0.5
    got = prefill_attention(*args, scale, window, sinks=sinks)
    want = prefill_attention_ref(*args, scale, window, sinks=sinks)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert not torch.allclose(want, prefill_attention_ref(*args, scale, window), atol=atol)
    # keys split across programs: the sink is counted in one split's sum only
    split = prefill_attention(*args, scale, window, sinks=sinks, num_splits=3)
    torch.testing.assert_close(split, want, atol=atol, rtol=rtol)


def test_bad_sinks_raise_before_launch(device):
    paged = random_paged_kv([5, 9], 2, 16, 16, torch.float32, device, seed=0)
    q = torch.randn(2, 4, 16, device=device)
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, 0.25)
    with pytest.raises(ValueError, match="sinks must have shape"):
        decode_attention(*args, sinks=torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="sinks must have dtype"):
        decode_attention(*args, sinks=torch.zeros(4, device=device, dtype=torch.float16))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="sinks must have shape"):
        prefill_attention(
            q, *args[1:3], cu, paged.seq_lens, 1, 0.25, sinks=torch.zeros(8, device=device)
        )


def _step(
    query_lens: list[int],
    seq_lens: list[int],
    kv_heads: int,
    dim: int,
    block: int,
    seed: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step over a random paged cache whose k, v are the cache's own keys and values at the
    query positions (so the backend's write changes nothing): (k, v, cache, cu, meta)."""
    paged = random_paged_kv(seq_lens, kv_heads, dim, block, torch.float32, device, seed)
    slots = torch.tensor(
        [
            int(paged.block_tables[i, p // block]) * block + p % block
            for i, (n_q, n) in enumerate(zip(query_lens, seq_lens, strict=True))
            for p in range(n - n_q, n)
        ],
        device=device,
    )
    cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int().to(device)
    meta = AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=cu,
        seq_lens=paged.seq_lens,
        block_tables=paged.block_tables,
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block,
    )
    keys, values = paged.kv_cache[:, slots // block, slots % block]
    return keys, values, paged.kv_cache, cu, meta


class _GptOssAttention(torch.nn.Module):
    """What `eager_attention_forward` reads from HF's GptOssAttention."""

    def __init__(self, sinks: torch.Tensor, num_key_value_groups: int) -> None:
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = num_key_value_groups


@pytest.mark.parametrize("window", [None, 6])
def test_torch_backend_with_sinks_is_hf_eager_gpt_oss_attention(window):
    # A chunk over a cached prefix, a decode row, a fresh prompt; GQA 8 / 2.
    query_lens, seq_lens, heads, kv_heads, dim, block = [9, 1, 20], [25, 30, 20], 8, 2, 16, 8
    cpu = torch.device("cpu")
    keys, values, cache, cu, meta = _step(query_lens, seq_lens, kv_heads, dim, block, 3, cpu)
    q = torch.randn(sum(query_lens), heads, dim)
    sinks = _sinks(heads, 3, torch.device("cpu"))
    scale = dim**-0.5
    backend = TorchPagedAttention(heads, kv_heads, dim, scale, sliding_window=window)
    got = backend.forward(q, keys, values, cache, meta, sinks=sinks)

    hf_layer = _GptOssAttention(sinks, heads // kv_heads).eval()
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        k, v = gather_context(cache, meta.block_tables[i], seq_len, block)
        q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= q_pos - k_pos < window
        # HF's additive mask: 0 where a key is seen, the dtype's minimum elsewhere.
        mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
        start, end = int(cu[i]), int(cu[i + 1])
        want, _ = eager_attention_forward(
            hf_layer,
            q[start:end].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            mask[None, None],
            scaling=scale,
        )
        torch.testing.assert_close(got[start:end], want[0])


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1], [25, 1, 40]), ([9, 1, 20], [25, 30, 20])],
    ids=["decode", "mixed"],
)
def test_backends_agree_with_sinks(query_lens, seq_lens, window, device):
    """The Triton backend (decode kernel for one-token steps, prefill kernel otherwise) gives
    the torch backend's output with a layer's sinks, through `rotate_and_forward` too (on a GPU
    the fused rotary + cache-write launch); the reference kernels agree with both."""
    heads, kv_heads, dim, block = 8, 2, 16, 8
    keys, values, cache, cu, meta = _step(query_lens, seq_lens, kv_heads, dim, block, 4, device)
    q = torch.randn(sum(query_lens), heads, dim, device=device)
    sinks = _sinks(heads, 4, device)
    torch_backend = TorchPagedAttention(heads, kv_heads, dim, 0.3, sliding_window=window)
    ops = TritonOps(pdl=False) if device.type == "cuda" else None
    triton_backend = TritonPagedAttention(heads, kv_heads, dim, 0.3, sliding_window=window, ops=ops)
    want = torch_backend.forward(q, keys, values, cache, meta, sinks=sinks)
    got = triton_backend.forward(q, keys, values, cache, meta, sinks=sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    ref = prefill_attention_ref(
        q, cache, meta.block_tables, cu, meta.seq_lens, max(query_lens), 0.3, window, sinks=sinks
    )
    torch.testing.assert_close(ref, want)

    # Position 0 rotates nothing: the same step through rotate_and_forward.
    rotary = RotaryEmbedding(RopeConfig(), dim, max_len=64)
    rotary.reset(device)
    positions = torch.zeros(sum(query_lens), dtype=torch.int64, device=device)
    args = (positions, q, keys, values, rotary, cache, meta)
    torch.testing.assert_close(torch_backend.rotate_and_forward(*args, sinks=sinks), want)
    rotated = triton_backend.rotate_and_forward(*args, sinks=sinks)
    torch.testing.assert_close(rotated, want, atol=2e-5, rtol=2e-5)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize(("preload", "pdl"), [(None, False), (True, True)])
def test_decode_with_sinks_real_shapes_on_gpu(dtype, window, preload, pdl):
    """gpt-oss-20b's attention (64 query / 8 KV heads of 64 dims; sliding layers' window 128)
    at batch 33 over up to 5000 tokens, a padding row among them, the split count the
    heuristic's."""
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(33)
    seq_lens = torch.randint(1, 5001, (33,), generator=gen).tolist()
    seq_lens[0], seq_lens[1] = 5000, 0
    paged = random_paged_kv(seq_lens, 8, 64, 16, dtype, cuda, seed=33)
    q = torch.randn(33, 64, 64, generator=gen).to(cuda, dtype)
    sinks = _sinks(64, 33, cuda)
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, 64**-0.5, window)
    got = decode_attention(*args, sinks=sinks, preload=preload, pdl=pdl)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, decode_attention_ref(*args, sinks=sinks), atol=atol, rtol=rtol)
    assert torch.all(got[1] == 0)


@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("window", [None, 128])
def test_prefill_with_sinks_real_shapes_on_gpu(dtype, window):
    cuda = torch.device("cuda")
    query_lens, seq_lens = [512, 1, 300, 1000], [4096, 700, 300, 1000]
    paged = random_paged_kv(seq_lens, 8, 64, 16, dtype, cuda, seed=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(query_lens), 64, 64, generator=gen).to(cuda, dtype)
    cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int().to(cuda)
    sinks = _sinks(64, 4, cuda)
    args = (q, paged.kv_cache, paged.block_tables, cu, paged.seq_lens, max(query_lens))
    got = prefill_attention(*args, 64**-0.5, window, sinks=sinks)
    want = prefill_attention_ref(*args, 64**-0.5, window, sinks=sinks)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
