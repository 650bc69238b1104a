"""CUDA graphs for decode steps: one captured forward + LM head per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a captured graph removes the
launch gaps and the Python in between. Inputs live in static buffers that each replay
overwrites, filled from pinned host mirrors with two copies per step; a batch of B sequences
runs the smallest bucket >= B, its extra rows padded:

    rows      [ 0 .. B-1 | B .. bucket-1 ]
    slot      [ real     | -1  (the KV write skips them)     ]
    seq_len   [ real     |  0  (attention returns zeros)      ]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.lora.batch import LoRABatch, group_rows, tile_capacity
from splitserve.engine.lora.manager import LoRAManager
from splitserve.engine.model import CausalLM
from splitserve.kernels.lora_ref import TILE_ROWS

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the captured output, [bucket, vocab_size]
    argmax: torch.Tensor  # [bucket] int64, each row's argmax (the greedy token)


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
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = tuple(b for b in BUCKETS if b <= max_batch) or (1,)
        size = self.buckets[-1]
        device = kv_caches[0].device
        # Rows of one int64 buffer: input ids, positions, slots. One int32 buffer: seq lens,
        # then the block tables, so a step's used part of it is one contiguous prefix.
        # Two more rows carry an overlapped step's tokens in: destination rows, source rows.
        self._ids_host = torch.zeros(5, size, dtype=torch.int64, pin_memory=True)
        self._ids_host[2] = -1  # no slots: capture's warm-up run writes no KV
        width = 1 + max_blocks_per_seq
        self._lens_host = torch.zeros(size * width, dtype=torch.int32, pin_memory=True)
        self._ids_np = self._ids_host.numpy()
        self._lens_np = self._lens_host.numpy()
        self._ids = self._ids_host.to(device)
        self._lens = torch.zeros_like(self._lens_host, device=device)
        self.input_ids, self.positions, self.slot_mapping, self._dst, self._src = self._ids
        self.seq_lens = self._lens[:size]
        self.block_tables = self._lens[size:].view(size, max_blocks_per_seq)
        self._copied = torch.cuda.Event()  # the host mirrors may be rewritten once it is done
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.max_model_len = max_model_len
        self._graphs: dict[int, _Graph] = {}
        # LoRA: each bucket is captured twice, without LoRA (steps with no adapter pay
        # nothing) and with the LoRA kernels, whose rows grouped by adapter are a graph input:
        # one int32 buffer of segments [3, capacity] (at most TILE_ROWS rows each; unused
        # ones slot -1, which the kernels skip) then the rows in that order, filled from a
        # pinned mirror with the step's other inputs. A bucket's capacity bounds its tiles
        # (`tile_capacity`: a step holds at most max_loras adapters).
        self.lora = lora
        self._lora_graphs: dict[int, _Graph] = {}
        self._lora_caps: dict[int, int] = {}
        if lora is not None:
            for bucket in self.buckets:
                caps = tile_capacity(bucket, lora.config.max_loras, TILE_ROWS)
                self._lora_caps[bucket] = caps
            lora_size = max(3 * self._lora_caps[b] + b for b in self.buckets)
            self._lora_host = torch.zeros(lora_size, dtype=torch.int32, pin_memory=True)
            self._lora_np = self._lora_host.numpy()
            self._lora_dev = self._lora_host.to(device)

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
                # NOTE: warm up all that the graph will hold, the LM head and argmax too:
                # kernels compile and libraries create their handles (cuBLAS) outside the
                # capture. With FP8 projections the LM head may be the first cuBLAS call.
                self.model.ops.argmax(self.model.compute_logits(self.model(*args)))
            torch.cuda.current_stream().wait_stream(stream)
            self._graphs[bucket] = self._capture_one(args, pool)
            if self.lora is not None:
                self.lora.context.batch = self._lora_batch(bucket)
                try:
                    with torch.cuda.stream(stream):  # warm-up: the LoRA kernels compile
                        self.model.compute_logits(self.model(*args))
                    torch.cuda.current_stream().wait_stream(stream)
                    self._lora_graphs[bucket] = self._capture_one(args, pool)
                finally:
                    self.lora.context.batch = None
        torch.cuda.synchronize()

    def _lora_batch(self, bucket: int) -> LoRABatch:
        """The bucket's views of the LoRA input buffer (segments all skipped until a step
        fills them)."""
        cap = self._lora_caps[bucket]
        segments = self._lora_dev[: 3 * cap].view(3, cap)
        segments[2].fill_(-1)
        return LoRABatch(segments, TILE_ROWS, self._lora_dev[3 * cap : 3 * cap + bucket])

    def _fill_lora(self, bucket: int, lora_slots: list[int]) -> None:
        """Write a step's rows grouped by adapter into the pinned mirror and start its copy
        (ordered before the replay; `_copied` guards the mirror until it is done)."""
        cap = self._lora_caps[bucket]
        segments, rows = group_rows(np.asarray(lora_slots, dtype=np.int64), TILE_ROWS)
        num = segments.shape[1]
        if num > cap:
            raise RuntimeError(f"{num} LoRA tiles in a step, but bucket {bucket} holds {cap}")
        view = self._lora_np[: 3 * cap].reshape(3, cap)
        view[:, :num] = segments
        view[1, num:] = 0
        view[2, num:] = -1
        self._lora_np[3 * cap : 3 * cap + len(rows)] = rows
        used = 3 * cap + bucket
        self._lora_dev[:used].copy_(self._lora_host[:used], non_blocking=True)

    def _capture_one(self, args: tuple, pool: Any) -> _Graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model.compute_logits(self.model(*args))
            argmax = self.model.ops.argmax(logits)
        return _Graph(graph, logits, argmax)

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
        carry: tuple[torch.Tensor, list[tuple[int, int]]] | None = None,
        lora_slots: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for len(input_ids) sequences: their logits [batch, vocab] and the
        argmax of each row [batch]. `carry` = (tokens on the device, [(row, source row)]) sets
        those rows' input ids from a step still in flight (engine/overlap.py)."""
        batch = len(input_ids)
        bucket = next(b for b in self.buckets if b >= batch)
        size = self.buckets[-1]
        self._copied.synchronize()
        ids = self._ids_np
        ids[0, :batch], ids[1, :batch], ids[2, :batch] = input_ids, positions, slots
        ids[:2, batch:bucket] = 0
        ids[2, batch:bucket] = -1
        lens = self._lens_np
        lens[:batch] = seq_lens
        lens[batch:bucket] = 0
        width = self.block_tables.shape[1]
        for row, table in enumerate(tables):
            # NOTE: entries past a table's length keep older values; the kernels read only the
            # blocks below each sequence's length.
            start = size + row * width
            lens[start : start + len(table)] = table
        moves = carry[1] if carry is not None else []
        if moves:
            ids[3, : len(moves)], ids[4, : len(moves)] = zip(*moves, strict=True)
        self._ids.copy_(self._ids_host, non_blocking=True)
        used = size + bucket * width
        self._lens[:used].copy_(self._lens_host[:used], non_blocking=True)
        graph = self._graphs[bucket]
        if lora_slots is not None:
            if self.lora is None:
                raise RuntimeError("a decode step with LoRA rows, but no LoRA graphs captured")
            self._fill_lora(bucket, lora_slots)
            graph = self._lora_graphs[bucket]
        self._copied.record()
        if moves:
            assert carry is not None
            k = len(moves)
            self.input_ids.index_copy_(0, self._dst[:k], carry[0].index_select(0, self._src[:k]))
        graph.graph.replay()
        return graph.logits[:batch], graph.argmax[:batch]
