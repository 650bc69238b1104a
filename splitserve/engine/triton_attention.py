"""Triton paged attention: the GPU backend (it also runs on the CPU under TRITON_INTERPRET=1).

Each layer's step is two or three launches: rotary embedding fused with the KV-cache write
(`rotate_and_forward`, on a GPU), then either the split-K decode kernel (every sequence has
exactly one query token) or the prefill/extend kernel for the whole batch (any mix of fresh
prompts, prefill chunks over a cached prefix, and decodes); both take the layer's attention
sinks, if any. Nothing here reads device memory on
the host, so the decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.kernels.decode_attention import decode_attention
from splitserve.kernels.kv_cache_write import write_kv_cache
from splitserve.kernels.prefill_attention import prefill_attention
from splitserve.kernels.rotary import rotary_embedding_write_kv


class TritonPagedAttention(AttentionBackend):
    """Paged attention with the kernels in `kernels/`."""

    graph_safe = True

    @property
    def pdl(self) -> bool:
        return bool(getattr(self.ops, "pdl", False))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # NOTE: the write comes first: both kernels read this step's keys from the cache.
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, pdl=self.pdl)
        return self._attend(q, kv_cache, meta, sinks)

    def rotate_and_forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.ops.triton:  # NOTE: the interpreter: torch's rotary, as the CPU engine does
            return super().rotate_and_forward(
                positions, q, k, v, rotary, kv_cache, meta, sinks=sinks
            )
        # One launch rotates q and k and writes the keys and values into the cache (an FP8 cache:
        # the rotated keys round to q's dtype first, then are quantized, as the unfused path).
        q = rotary_embedding_write_kv(
            positions, q, k, v, rotary.cos, rotary.sin, kv_cache, meta.slot_mapping, pdl=self.pdl
        )
        return self._attend(q, kv_cache, meta, sinks)

    def _attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        if meta.max_query_len == 1:
            # NOTE: the split count comes from the block tables' width, not from seq_lens_cpu,
            # so a CUDA graph captured with padded tables still splits for the longest context
            # it can replay (seq_len 0 padding rows come out as zeros).
            return decode_attention(
                q,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                self.scale,
                self.sliding_window,
                pdl=self.pdl,
                sinks=sinks,
            )
        return prefill_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.max_query_len,
            self.scale,
            self.sliding_window,
            sinks=sinks,
            max_seq_len=meta.max_seq_len,
        )
