"""What a worker's front tells the registry about it on every heartbeat (torch-free: the
front never loads the engine)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.runtime.engine_watch import EngineWatch


def worker_info(
    kind: str,
    worker_id: str,
    address: str,
    watch: EngineWatch,
    kv_transports: tuple[str, ...] = (),
    limits: Mapping[str, Any] | None = None,
) -> WorkerInfo:
    """What a worker's heartbeat tells the registry: its load and free blocks and its loop's
    recent pace (from `watch`, which raises `Stalled` for a loop that stopped turning), and
    the limits of its engine that a request must respect (`engine_limits`, from its core)."""
    stats = watch.latest()
    return WorkerInfo(
        worker_id=worker_id,
        kind=kind,
        address=address,
        load=stats.load,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        block_size=stats.block_size,
        kv_transports=kv_transports,
        max_num_seqs=limits["max_num_seqs"] if limits else 0,
        max_model_len=limits["max_model_len"] if limits else 0,
        kv_dtype=limits["kv_dtype"] if limits else "",
        tensor_parallel_size=limits.get("tensor_parallel_size", 1) if limits else 1,
        adapters=tuple(stats.lora_adapters),
        pace_ms=round(watch.pace_s * 1000),
    )
