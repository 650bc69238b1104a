"""What prefill and decode workers share at start-up: their engine, and what they tell the
registry about themselves."""

from __future__ import annotations

from engine.config import EngineConfig, parse_dtype, resolve_device
from engine.llm_engine import LLMEngine
from kv_transfer.registry import WorkerInfo
from splitserve.settings import ServiceSettings, WorkerSettings


def build_engine(
    service: ServiceSettings, worker: WorkerSettings, record_prefix_events: bool = False
) -> LLMEngine:
    device = resolve_device(worker.device)
    config = EngineConfig(
        record_prefix_events=record_prefix_events,
        dtype=parse_dtype(worker.dtype, device),
        device=device,
        block_size=worker.block_size,
        num_kv_blocks=worker.num_kv_blocks,
        kv_cache_memory_bytes=worker.kv_cache_memory_bytes,
        max_num_batched_tokens=worker.max_num_batched_tokens,
        max_num_seqs=worker.max_num_seqs,
    )
    return LLMEngine(service.model, config)


def worker_info(
    kind: str, worker_id: str, address: str, engine: LLMEngine, extra_load: int
) -> WorkerInfo:
    """What a worker's heartbeat tells the registry (its load and free blocks)."""
    usage = engine.kv_usage()
    load = len(engine.scheduler.running) + len(engine.scheduler.waiting) + extra_load
    return WorkerInfo(
        worker_id=worker_id,
        kind=kind,
        address=address,
        load=load,
        num_free_blocks=usage.num_free_blocks + usage.num_cached_blocks,
        num_total_blocks=usage.num_total_blocks,
    )
