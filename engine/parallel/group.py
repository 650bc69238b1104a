"""The collectives a tensor-parallel model needs, over one process group per engine.

NCCL between GPUs, gloo on the CPU (so CI runs TP=2 with real processes on one machine). The
group is built from its own TCP store, not torch.distributed's global default group: two
engines in one process (a test's TP=1 beside TP=2) never share or fight over global state.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve.engine.parallel.sharding import SINGLE, Shard

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)
# NOTE: a follower's wait for the next step; rank 0's death ends it anyway (a closed
# connection, or the follower's parent watch).
_FOREVER = datetime.timedelta(days=365)


class ParallelGroup:
    """One rank: every collective is the identity (TP=1 pays nothing)."""

    shard: Shard = SINGLE

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns it."""
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, rank order."""
        return x

    def broadcast(
        self, x: torch.Tensor, root: int = 0, *, wait_forever: bool = False
    ) -> torch.Tensor:
        """`root`'s `x` on every rank, in place; returns it. `wait_forever`: no timeout on
        this rank (a follower waiting for rank 0's next step, however long it idles)."""
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        return value

    def close(self) -> None:
        """Release the group (idempotent)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where ranks meet: rank 0 listens on host:port (a TCP store) for the others."""

    host: str
    port: int
    timeout_s: float = DEFAULT_TIMEOUT.total_seconds()  # of a collective
    join_timeout_s: float = DEFAULT_TIMEOUT.total_seconds()  # for every rank to join


class TorchGroup(ParallelGroup):
    """A c10d backend (NCCL or gloo) over `shard.size` processes."""

    def __init__(
        self,
        shard: Shard,
        rendezvous: Rendezvous,
        device: torch.device,
        check_peers: Callable[[], None] | None = None,
    ) -> None:
        """Join the group (blocks until every rank has). Rank 0 calls `check_peers` while it
        waits, so that a follower that died while starting fails it at once, not at the
        timeout."""
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        self.shard = shard
        self.device = device
        self._store = dist.TCPStore(
            rendezvous.host,
            rendezvous.port,
            shard.size,
            shard.rank == 0,
            timeout=datetime.timedelta(seconds=rendezvous.join_timeout_s),
            wait_for_workers=False,
        )
        if shard.rank == 0:
            self._wait_for_peers(rendezvous.join_timeout_s, check_peers)
        else:
            self._store.set(f"joined/{shard.rank}", "1")
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            if hasattr(opts, "_timeout"):  # NOTE: private in torch's binding
                opts._timeout = timeout
            # NOTE: Any: torch's stubs type the backends' collectives loosely.
            self._pg: Any = dist.ProcessGroupNCCL(self._store, shard.rank, shard.size, opts)
        else:
            self._pg = dist.ProcessGroupGloo(self._store, shard.rank, shard.size, timeout)
        self._closed = False

    def _wait_for_peers(self, timeout_s: float, check_peers: Callable[[], None] | None) -> None:
        keys = [f"joined/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self._store.check(keys):
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not join within {timeout_s} s")
            time.sleep(0.05)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._pg.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(
        self, x: torch.Tensor, root: int = 0, *, wait_forever: bool = False
    ) -> torch.Tensor:
        if wait_forever:
            self._pg.broadcast(x, root, _FOREVER).wait()
        else:
            self._pg.broadcast(x, root).wait()
        return x

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._pg.allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            # NOTE: a peer already gone leaves nothing to release cleanly.
            with contextlib.suppress(RuntimeError):
                shutdown()
