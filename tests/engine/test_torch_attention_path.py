"""The plain-torch attention backend runs SDPA's fused kernel on the CPU, not its math path.

A later turn of a conversation extends a long cached prefix by a few hundred tokens; with 3-D
inputs SDPA falls back to its math path there, which made that prefill several times slower on
the CPU (bench/prefix_reuse.py `turns`). The check is on the kernel SDPA picks, not on time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitserve.engine import torch_attention
from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.torch_attention import TorchPagedAttention
from tests.kernels.paged_inputs import random_paged_kv


def _extend_over_cached_prefix(
    backend: TorchPagedAttention,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One sequence: 5 new queries over a 40-token context (35 cached), 8-token blocks."""
    query_len, seq_len, block = 5, 40, 8
    paged = random_paged_kv([seq_len], backend.num_kv_heads, 16, block, torch.float32, "cpu", 1)
    slots = torch.tensor(
        [int(paged.block_tables[0, p // block]) * block + p % block
         for p in range(seq_len - query_len, seq_len)]
    )  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=torch.tensor([0, query_len], dtype=torch.int32),
        seq_lens=paged.seq_lens,
        block_tables=paged.block_tables,
        query_lens_cpu=(query_len,),
        seq_lens_cpu=(seq_len,),
        block_size=block,
    )
    q = torch.randn(query_len, backend.num_heads, 16, generator=torch.Generator().manual_seed(2))
    return q, paged.kv_cache, meta


@pytest.mark.parametrize("window", [None, 12])
def test_torch_backend_attends_with_the_fused_cpu_kernel(window, monkeypatch):
    backend = TorchPagedAttention(4, 2, 16, 0.25, sliding_window=window)
    q, kv_cache, meta = _extend_over_cached_prefix(backend)
    pages, offsets = meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size
    keys, values = kv_cache[:, pages, offsets]
    chosen: list[int] = []
    real = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        chosen.append(torch._fused_sdp_choice(query, key, value, attn_mask))
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch_attention.F, "scaled_dot_product_attention", recording)
    got = backend.forward(q, keys, values, kv_cache.clone(), meta)
    assert chosen == [int(SDPBackend.FLASH_ATTENTION)]
    monkeypatch.undo()
    with sdpa_kernel(SDPBackend.MATH):  # NOTE: the reference: the math path, same inputs
        want = backend.forward(q, keys, values, kv_cache.clone(), meta)
    torch.testing.assert_close(got, want)
