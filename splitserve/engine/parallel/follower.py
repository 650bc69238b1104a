"""A follower rank: loads its shard, holds its KV-cache shard, and runs every step rank 0
plans until rank 0 stops it (or dies: then this process exits too)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache, size_kv_pool
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.parallel.group import FOREVER, TorchGroup
from splitserve.engine.parallel.kv_shards import gather_blocks, scatter_blocks
from splitserve.engine.parallel.launch_args import FollowerArgs
from splitserve.engine.parallel.sharding import Shard, local_config
from splitserve.engine.parallel.step_plan import StepPlan, StepPlanChannel
from splitserve.engine.platform import Platform
from splitserve.engine.weights import load_model

# NOTE: named, not __name__: this module runs as __main__ in the follower's process.
log = logging.getLogger("splitserve.engine.parallel.follower")

_PARENT_POLL_S = 1.0


def _exit_with_parent() -> None:
    """Leave when rank 0's process is gone (killed, say): a collective waiting on it would
    otherwise hold this process, and its GPU, until the backend's timeout."""
    parent = os.getppid()
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def main(args: FollowerArgs) -> None:
    """Run rank `args.rank` of `config.tensor_parallel_size`; `args.config` is rank 0's (with
    this rank's device)."""
    config, rank, model_dir = args.config, args.rank, args.model_dir
    threading.Thread(target=_exit_with_parent, daemon=True, name="tp-parent-watch").start()
    platform = Platform.resolve(config)
    platform.activate()
    # NOTE: a follower's collectives wait as long as rank 0 takes (NCCL's watchdog would
    # otherwise end this process when the engine idles past the timeout, whether or not the
    # backend honours a per-call one); if rank 0 dies or hangs, its own timeout ends it and
    # `_exit_with_parent` ends this process.
    rendezvous = dataclasses.replace(args.rendezvous, timeout_s=FOREVER.total_seconds())
    start = time.monotonic()
    group = TorchGroup(
        Shard(rank, config.tensor_parallel_size),
        rendezvous,
        platform.device,
        peer_all_reduce_bytes=config.tensor_parallel_peer_all_reduce_bytes,
    )
    log.info("rank %d on %s: joined the group (%s)", rank, platform.device, group.backend)
    try:
        model_config = ModelConfig.from_pretrained(model_dir)
        model = load_model(Path(model_dir), model_config, config, platform, group)
        log.info("rank %d: weights loaded at %.1f s", rank, time.monotonic() - start)
        config = agree_on_kv_pool(local_config(model_config, group.shard), config, platform, group)
        kv_cache = KVCache.allocate(local_config(model_config, group.shard), config)
        runner = ModelRunner(model, kv_cache, config)
        if platform.cuda_graphs:  # NOTE: as rank 0 does, in the same order (their collectives)
            runner.capture_cuda_graphs()
        log.info(
            "rank %d: %d KV blocks, graphs %s; ready at %.1f s",
            rank,
            config.num_kv_blocks,
            "captured" if platform.cuda_graphs else "off",
            time.monotonic() - start,
        )
        channel = StepPlanChannel(group, platform.device)
        num_kv_heads = model_config.num_kv_heads
        with torch.inference_mode():
            while (plan := channel.recv()) is not None:
                if isinstance(plan, StepPlan):
                    runner.follow(plan)
                elif plan.write:
                    scatter_blocks(group, kv_cache.pool, plan.block_ids, num_kv_heads)
                else:
                    gather_blocks(group, kv_cache.pool, plan.block_ids, num_kv_heads)
    except RuntimeError:
        # NOTE: rank 0 went away mid-collective (it reports its own failure), or this rank
        # failed (out of memory, say): rank 0 sees it exit.
        log.warning("tensor-parallel rank %d: stopped", rank, exc_info=True)
        group.close(abort=True)
        os._exit(1)
    except BaseException:
        group.close(abort=True)
        raise
    # NOTE: rank 0 releases its communicator as it sends the stop (launcher.py): NCCL's
    # destroy waits for every rank of the host. The graphs that captured it go first.
    runner.release_cuda_graphs()
    group.close()


def agree_on_kv_pool(
    local: ModelConfig, config: EngineConfig, platform: Platform, group: TorchGroup
) -> EngineConfig:
    """Every rank's pool gets the block count the tightest rank can hold (rank 0's block ids
    address every rank's shard). Each rank calls this once, in the same order."""
    sized = size_kv_pool(local, config, platform.kv_cache_budget(config))
    assert sized.num_kv_blocks is not None
    return dataclasses.replace(sized, num_kv_blocks=group.min_int(sized.num_kv_blocks))


if __name__ == "__main__":
    # NOTE: a line per start-up phase, timestamped (a start that stalls shows where).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)
    main(FollowerArgs.from_json(sys.argv[1]))
    # NOTE: no interpreter teardown: the backend's destructors may wait on peers already gone.
    logging.shutdown()
    os._exit(0)
