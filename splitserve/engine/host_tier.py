"""The host-memory KV tier: pinned host memory holding whole blocks of the block-major pool,
and the copies between it and the GPU (`--kv-host-cache-gb`).

The block manager decides (engine/host_index.py: which hash sits in which slot); this copies,
once per step, before the step's forward:

    saves   block -> host slot        on a side stream, after what the compute stream has done so
                                      far (the step that filled them): off the step's path
    loads   host slot -> new block    on the compute stream, after every save issued (a block
                                      just saved may be the one loaded into): the step that
                                      reads them is next; a step that gives new tokens a block
                                      still being saved waits for the saves too

Every block is saved once, when it is first hashed (write-through), so evicting it from the GPU
costs nothing later and a preempted sequence's full blocks come back as a prefix hit; its partly
filled last block is saved when it is preempted (`BlockManager.swap_out`), so it resumes with
no token computed again (swap instead of recompute). On the CPU the "host" is the same memory
and the copies are synchronous.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from splitserve.engine.host_index import HostIndex, HostWork, contiguous_runs
from splitserve.engine.kv_cache import KVCache


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_index(num_bytes: int | None, cache: KVCache, tensor_parallel: bool) -> HostIndex | None:
    """The host tier's slots, when `num_bytes` (`kv_host_cache_bytes`) asks for one."""
    if num_bytes is None:
        return None
    if cache.window_pool is not None or tensor_parallel:
        raise ValueError(
            "--kv-host-cache-gb: not yet with sliding layers' window pool "
            "(sliding_window_kv=False) or tensor parallelism"
        )
    return HostIndex(host_tier_slots(num_bytes, cache.block_bytes))


def host_tier_slots(num_bytes: int, block_bytes: int) -> int:
    """Blocks `num_bytes` of host memory hold; a clear error when the host cannot give them."""
    slots = num_bytes // block_bytes
    if slots < 1:
        raise ValueError(
            f"--kv-host-cache-gb: {num_bytes} bytes hold no block ({block_bytes} bytes each)"
        )
    free = available_host_bytes()
    if free is not None and num_bytes > 0.9 * free:
        raise ValueError(
            f"--kv-host-cache-gb: {num_bytes / 2**30:.1f} GiB of pinned host memory asked, "
            f"{free / 2**30:.1f} GiB available on this host: ask for at most 90% of it"
        )
    return int(slots)


class HostTier:
    """Pinned host blocks shaped like the pool's, and the copies to and from it."""

    def __init__(self, pool: torch.Tensor, index: HostIndex) -> None:
        self.pool = pool
        self.index = index
        pin = pool.is_cuda
        self.blocks = torch.empty(
            (index.num_slots, *pool.shape[1:]), dtype=pool.dtype, pin_memory=pin
        )
        self._block_bytes = int(pool[0].numel() * pool.element_size())
        self._stream = torch.cuda.Stream(device=pool.device) if pin else None
        self._saved: torch.cuda.Event | None = None  # after the last save issued
        self.bytes_saved = 0
        self.bytes_loaded = 0
        self.copy_seconds = 0.0

    def saves_landed(self) -> bool:
        """Whether every save issued so far is done."""
        return self._saved is None or self._saved.query()

    def run(self, work: HostWork) -> None:
        """Issue `work`'s copies: saves first (a block saved may be the target of a load),
        then loads, which wait for every save issued (as does a step that reuses a block)."""
        if not (work.saves or work.loads or work.reused):
            return
        start = time.perf_counter()
        compute = torch.cuda.current_stream() if self._stream is not None else None
        if work.saves and self._stream is not None and compute is not None:
            self._stream.wait_stream(compute)  # NOTE: the step that filled them
            with torch.cuda.stream(self._stream):
                for block_id, slot, n in contiguous_runs(work.saves):
                    self.blocks[slot : slot + n].copy_(
                        self.pool[block_id : block_id + n], non_blocking=True
                    )
                self._saved = torch.cuda.Event()
                self._saved.record()
        else:
            for block_id, slot, n in contiguous_runs(work.saves):
                self.blocks[slot : slot + n].copy_(self.pool[block_id : block_id + n])
        self.bytes_saved += len(work.saves) * self._block_bytes
        if compute is not None and self._saved is not None and (work.loads or work.reused):
            compute.wait_event(self._saved)
        for slot, block_id, n in contiguous_runs(work.loads):  # NOTE: pinned: asynchronous
            self.pool[block_id : block_id + n].copy_(
                self.blocks[slot : slot + n], non_blocking=compute is not None
            )
        self.bytes_loaded += len(work.loads) * self._block_bytes
        self.copy_seconds += time.perf_counter() - start

    def stats(self) -> dict[str, Any]:
        """Its figures, under `EngineStats`' names (engine/stats.py)."""
        return {
            "host_cache_blocks": len(self.index),
            "host_cache_hits": self.index.num_hits,
            "host_cache_bytes_saved": self.bytes_saved,
            "host_cache_bytes_loaded": self.bytes_loaded,
            "host_cache_copy_seconds": self.copy_seconds,
        }
