"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a captured graph removes the
launch gaps and the Python in between. Inputs live in static buffers that each replay
overwrites; a batch of B sequences runs the smallest bucket >= B, its extra rows padded:

    rows      [ 0 .. B-1 | B .. bucket-1 ]
    slot      [ real     | -1  (the KV write skips them)     ]
    seq_len   [ real     |  0  (attention returns zeros)      ]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.model import CausalLM

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the captured output, [bucket, hidden_size]


class DecodeGraphs:
    """Captured decode forwards for every bucket up to `max_batch`."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = tuple(b for b in BUCKETS if b <= max_batch) or (1,)
        size = self.buckets[-1]
        device = kv_caches[0].device
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.max_model_len = max_model_len
        self._graphs: dict[int, _Graph] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _meta(self, bucket: int) -> AttentionMetadata:
        # NOTE: the host-side lengths only size the kernels' launch grids (splits over the
        # context); capturing at the longest context keeps every replay within them.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            cu_seqlens_q=self.cu_seqlens_q[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            query_lens_cpu=(1,) * bucket,
            seq_lens_cpu=(self.max_model_len,) * bucket,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):  # largest first, so smaller ones reuse its pool
            meta = self._meta(bucket)
            args = (self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.model(*args)  # warm-up: compiles kernels outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(*args)
            self._graphs[bucket] = _Graph(graph, hidden)
        torch.cuda.synchronize()

    def can_run(self, batch: int) -> bool:
        return 0 < batch <= self.max_batch and bool(self._graphs)

    @torch.inference_mode()
    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """One decode forward for len(input_ids) sequences; returns their hidden states."""
        batch = len(input_ids)
        bucket = next(b for b in self.buckets if b >= batch)
        width = self.block_tables.shape[1]
        padded = [t + [0] * (width - len(t)) for t in tables]
        pad = bucket - batch
        self.input_ids[:bucket].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slot_mapping[:bucket].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.seq_lens[:bucket].copy_(
            torch.tensor(seq_lens + [0] * pad, dtype=torch.int32), non_blocking=True
        )
        self.block_tables[:batch].copy_(torch.tensor(padded, dtype=torch.int32), non_blocking=True)
        self._graphs[bucket].graph.replay()
        return self._graphs[bucket].hidden[:batch]
