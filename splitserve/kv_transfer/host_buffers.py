"""Reusable host byte buffers for KV payloads: pinned when the pool is on a GPU, so device copies
are asynchronous and fast; pinning is slow, so buffers are kept and reused."""

from __future__ import annotations

import threading

import torch


class HostBuffers:
    """Reusable host byte buffers (pinned when the pool is on a GPU, so device copies are
    asynchronous and fast). Pinning is slow, so buffers are kept and reused."""

    def __init__(self, pinned: bool, keep: int = 4) -> None:
        self.pinned = pinned
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly `num_bytes` (a view of a buffer at least that large)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= num_bytes:
                    return self._free.pop(i)[:num_bytes]
        size = 1 << max(20, (num_bytes - 1).bit_length())  # powers of two from 1 MiB
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)[:num_bytes]

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        with self._lock:
            self._free.append(base)
            self._free.sort(key=lambda b: b.numel())
            del self._free[: max(0, len(self._free) - self.keep)]
