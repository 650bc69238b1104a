"""What every step over static buffers shares, replayed as CUDA graphs per batch-size bucket.

A step writes its inputs into host mirrors (numpy views of tensors pinned on a GPU), copies them
to static device buffers that the captured graphs read, and replays the graph of the smallest
bucket that holds its batch. One event guards the mirrors: a step waits until the previous
step's copies are done before rewriting them (`begin`) and marks its own once issued
(`uploaded`). Capture goes largest bucket first, so smaller ones reuse its memory pool, and
runs each bucket's function once on a side stream first: kernels compile and libraries make
their handles (cuBLAS) outside the capture.

Users: the plain decode graphs (engine/cuda_graphs.py) and speculative verification and
drafting (engine/spec_decode/graphs.py). Without a GPU nothing is pinned or captured and the
same buffers are run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from splitserve.engine.model import CausalLM

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

T = TypeVar("T")


class Mirror:
    """A host tensor (pinned on a GPU; written through `np`) and its static device copy."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host = host.pin_memory() if device.type == "cuda" else host
        self.np: np.ndarray = self.host.numpy()
        self.dev = self.host.to(device)

    def upload(self, num_rows: int | None = None) -> None:
        """Copy the mirror (its first `num_rows` rows) to the device, asynchronously from pinned
        memory; the caller's `uploaded` then guards the mirror until the copy is done."""
        if num_rows is None:
            self.dev.copy_(self.host, non_blocking=True)
        else:
            self.dev[:num_rows].copy_(self.host[:num_rows], non_blocking=True)


class GraphCapture:
    """One capture run: the memory pool its graphs share and the side stream of warm-ups."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def warm_up(self, fn: Callable[[], object]) -> None:
        """Run `fn` once on the side stream, ordered after and before the current stream."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            fn()
        current.wait_stream(self.stream)

    def graph(self, fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """A graph of `fn` and the static output that each replay rewrites."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


class StaticSteps:
    """The model, its KV caches and the batch buckets of a kind of step over static buffers."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        buckets: tuple[int, ...],
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = buckets
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = kv_caches[0].device
        # NOTE: without a GPU nothing is in flight: there is no copy to wait for.
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._cu_seqlens: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket that holds `batch` rows (at most `max_batch`)."""
        return next(b for b in self.buckets if b >= batch)

    def mirror(self, host: torch.Tensor) -> Mirror:
        """A static device buffer holding `host`'s values, fed from a mirror of it."""
        return Mirror(host, self.device)

    def cu_seqlens(self, width: int) -> torch.Tensor:
        """[max_batch + 1] query starts of rows of `width` tokens each (a static buffer)."""
        cu = self._cu_seqlens.get(width)
        if cu is None:
            end = (self.max_batch + 1) * width
            cu = torch.arange(0, end, width, dtype=torch.int32, device=self.device)
            self._cu_seqlens[width] = cu
        return cu

    def begin(self) -> None:
        """Before the host mirrors are rewritten: the last step's copies are done."""
        if self._copied is not None:
            self._copied.synchronize()

    def uploaded(self) -> None:
        """After a step's copies are issued: the mirrors are busy until they are done."""
        if self._copied is not None:
            self._copied.record()

    @torch.inference_mode()
    def capture_buckets(self, capture_bucket: Callable[[int, GraphCapture], Any]) -> None:
        """`capture_bucket(bucket, capture)` for every bucket, largest first, in one capture
        run (one memory pool); the device is idle when it returns."""
        capture = GraphCapture()
        for bucket in reversed(self.buckets):
            capture_bucket(bucket, capture)
        torch.cuda.synchronize()
