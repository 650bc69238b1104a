"""WorkerStats from an engine, read on the engine thread so the numbers agree with each other."""

from __future__ import annotations

from engine.engine_loop import EngineLoop
from protos.v1 import worker_pb2


def worker_stats(loop: EngineLoop, worker_id: str, **counters: int) -> worker_pb2.WorkerStats:
    def read(engine) -> worker_pb2.WorkerStats:
        usage = engine.kv_usage()
        return worker_pb2.WorkerStats(
            worker_id=worker_id,
            num_total_blocks=usage.num_total_blocks,
            num_free_blocks=usage.num_free_blocks + usage.num_cached_blocks,
            num_cached_blocks=usage.num_cached_blocks,
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            prefix_cache_hit_tokens=engine.block_manager.prefix_cache_hits,
            num_requests=engine.num_requests(),
            **counters,
        )

    return loop.call(read)
