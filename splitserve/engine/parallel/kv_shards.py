"""The KV connector of a tensor-parallel engine: transports see whole blocks with every KV head,
whatever the degree, and rank 0 gathers or scatters the heads over the process group.

    rank r's pool block   [layers, 2, block_size, heads of rank r, head_dim]
    a block on the wire   [layers, 2, block_size, all KV heads,   head_dim]   (as at TP=1)

    read  (prefill side): all-gather every rank's copy of the blocks; rank 0 puts the distinct
                          head ranges side by side (a replicated head is taken once)
    write (decode side):  broadcast the whole blocks; each rank keeps its own head range

So a prefill worker at TP=a and a decode worker at TP=b exchange the same bytes as two TP=1
workers (gRPC transport). NOTE: the pool here is not the wire's bytes, so a one-sided transport
(NIXL) that writes into a registered pool can't serve it: `KVRegion.addressable` is False.

Transports call `read_blocks` / `write_blocks` from their own threads, but collectives must be
issued in one order on every rank: the engine thread runs them, between steps, when it drains
the connector's queue (`drain_releases`, called every loop turn even when idle).
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector, KVRegion, ReadyBlocks
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.parallel.group import ParallelGroup
from splitserve.engine.parallel.launcher import Followers
from splitserve.engine.parallel.sharding import Shard, kv_head_range
from splitserve.engine.parallel.step_plan import KVBlocksOp

_WAIT_S = 120.0


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes-preserving view the collectives and indexed copies take (FP8 moves as bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_blocks(
    group: ParallelGroup, pool: torch.Tensor, block_ids: Sequence[int], num_kv_heads: int
) -> torch.Tensor:
    """Every rank: its heads of `block_ids`, all-gathered; returns whole-head blocks
    [n, layers, 2, block_size, num_kv_heads, dim] (meaningful on every rank, used on rank 0)."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
    local = _raw(pool).index_select(0, index)
    parts = group.all_gather_last(local.unsqueeze(-1))  # [..., heads_local, dim, ranks]
    per_rank = parts.unbind(-1)
    first_ranks: dict[tuple[int, int], int] = {}
    for rank in range(group.world_size):
        first_ranks.setdefault(kv_head_range(num_kv_heads, Shard(rank, group.world_size)), rank)
    ordered = [per_rank[first_ranks[key]] for key in sorted(first_ranks)]
    return torch.cat(ordered, dim=-2)


def scatter_blocks(
    group: ParallelGroup,
    pool: torch.Tensor,
    block_ids: Sequence[int],
    num_kv_heads: int,
    data: torch.Tensor | None = None,
) -> None:
    """Every rank: rank 0's whole-head `data` for `block_ids` is broadcast, and each rank
    writes its head range of it into its pool (followers pass no `data`)."""
    raw = _raw(pool)
    shape = (len(block_ids), *raw.shape[1:4], num_kv_heads, raw.shape[5])
    if data is None:
        data = torch.empty(shape, dtype=raw.dtype, device=pool.device)
    else:
        data = _raw(data).to(pool.device).contiguous()
    group.broadcast(data)
    start, end = kv_head_range(num_kv_heads, group.shard)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
    raw.index_copy_(0, index, data[..., start:end, :])


class ShardedKVConnector(KVConnector):
    """Rank 0's connector: whole-head blocks for the transports (module docstring)."""

    def __init__(
        self,
        cache: KVCache,
        block_manager: BlockManager,
        block_size: int,
        followers: Followers,
        model_config: ModelConfig,
    ) -> None:
        super().__init__(cache, block_manager, block_size)
        self._followers = followers
        self._num_kv_heads = model_config.num_kv_heads
        self._ops: queue.SimpleQueue[tuple[KVBlocksOp, torch.Tensor, Future[None]]] = (
            queue.SimpleQueue()
        )

    def region(self) -> KVRegion:
        local = super().region()
        per_head = local.block_bytes // local.num_kv_heads
        return dataclasses.replace(
            local,
            num_kv_heads=self._num_kv_heads,
            block_bytes=per_head * self._num_kv_heads,
            addressable=False,
        )

    def read_blocks(
        self, block_ids: Sequence[int], out: torch.Tensor, ready: ReadyBlocks | None = None
    ) -> torch.Tensor:
        self._run(KVBlocksOp(False, tuple(block_ids)), out)
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        self._run(KVBlocksOp(True, tuple(block_ids)), data)

    def _run(self, op: KVBlocksOp, data: torch.Tensor) -> None:
        done: Future[None] = Future()
        self._ops.put((op, data, done))
        done.result(_WAIT_S)

    def drain_releases(self) -> None:
        super().drain_releases()
        while True:
            try:
                op, data, done = self._ops.get_nowait()
            except queue.Empty:
                return
            try:
                self._serve(op, data)
            except BaseException as exc:
                done.set_exception(exc)
                raise
            done.set_result(None)

    def _serve(self, op: KVBlocksOp, data: torch.Tensor) -> None:
        """Engine thread: run `op` with every rank."""
        followers = self._followers
        assert followers.group is not None and followers.channel is not None
        followers.check()
        followers.channel.send_kv(op)
        pool = self._cache.pool
        if op.write:
            scatter_blocks(followers.group, pool, op.block_ids, self._num_kv_heads, data)
        else:
            blocks = gather_blocks(followers.group, pool, op.block_ids, self._num_kv_heads)
            _raw(data).copy_(blocks.reshape(_raw(data).shape))
