"""The collectives a tensor-parallel model needs, over one process group per engine.

NCCL between GPUs, gloo on the CPU (so CI runs TP=2 with real processes on one machine). The
group is built from its own TCP store, not torch.distributed's global default group: two
engines in one process (a test's TP=1 beside TP=2) never share or fight over global state.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve.engine.parallel.peer_all_reduce import PeerAllReduce, try_peer_all_reduce
from splitserve.engine.parallel.sharding import SINGLE, Shard

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)
# NOTE: a follower's wait for the next step; rank 0's death ends it anyway (a closed
# connection, or the follower's parent watch).
FOREVER = datetime.timedelta(days=365)
# NOTE: how long `close` waits for the backend to release its communicator: NCCL's destroy
# waits on the host's other ranks, and one that never calls it would hold this rank forever.
CLOSE_TIMEOUT_S = 10.0


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

    def close(self, *, abort: bool = False) -> None:
        """Release the group (idempotent). `abort`: a peer is gone, so don't wait on it."""


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
        peer_all_reduce_bytes: int = 0,
    ) -> None:
        """Join the group (blocks until every rank has). Rank 0 calls `check_peers` while it
        waits, so that a follower that died while starting fails it at once, not at the
        timeout. `peer_all_reduce_bytes` > 0 (GPUs only): all-reduces up to that size go over
        peer memory, not NCCL (peer_all_reduce.py), where every rank can set it up."""
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
        self._closed = False
        self._connect(rendezvous, check_peers)
        self._peer: PeerAllReduce | None = None
        if peer_all_reduce_bytes > 0 and device.type == "cuda" and shard.size > 1:
            name = f"splitserve-tp-{rendezvous.host}-{rendezvous.port}"
            self._peer = try_peer_all_reduce(
                self._store, name, shard.rank, shard.size, device, self._pg, peer_all_reduce_bytes
            )

    @property
    def peer_all_reduce(self) -> bool:
        """Whether small all-reduces go over peer memory (else all go to NCCL or gloo)."""
        return self._peer is not None

    def _make_backend(self, timeout: datetime.timedelta) -> None:
        shard = self.shard
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            if hasattr(opts, "_timeout"):  # NOTE: private in torch's binding
                opts._timeout = timeout
            # NOTE: Any: torch's stubs type the backends' collectives loosely.
            self._pg: Any = dist.ProcessGroupNCCL(self._store, shard.rank, shard.size, opts)
        else:
            self._pg = dist.ProcessGroupGloo(self._store, shard.rank, shard.size, timeout)
        # NOTE: one tiny collective forms the communicator now, while every rank is known to
        # be alive: NCCL forms it lazily, at the first collective, in a call that waits in C
        # for every rank with no timeout (gloo connects in its constructor, with one).
        self.min_int(0)

    def _connect(self, rendezvous: Rendezvous, check_peers: Callable[[], None] | None) -> None:
        """Build the backend and form its communicator. Rank 0 does it on a helper thread and
        keeps checking its peers and the clock: a follower that died after joining fails it
        at once (`check_peers` raises), one that hangs at `join_timeout_s`."""
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        if check_peers is None:
            self._make_backend(timeout)
            return
        errors: list[BaseException] = []
        # NOTE: the current GPU is per thread: the helper takes this thread's (a bare "cuda").
        gpu = self.device.index
        if self.device.type == "cuda" and gpu is None:
            gpu = torch.cuda.current_device()

        def connect() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(gpu)
                self._make_backend(timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                errors.append(exc)

        helper = threading.Thread(target=connect, daemon=True, name="tp-connect")
        helper.start()
        deadline = time.monotonic() + rendezvous.join_timeout_s
        while helper.is_alive():
            check_peers()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor-parallel ranks joined but formed no {self.backend} communicator "
                    f"within {rendezvous.join_timeout_s} s"
                )
            helper.join(0.05)
        if errors:
            raise errors[0]

    @property
    def backend(self) -> str:
        return "NCCL" if self.device.type == "cuda" else "gloo"

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
        peer = self._peer
        if peer is not None and peer.fits(x):
            return peer(x)
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
        # NOTE: the options form, which every torch release binds (the (tensor, root, timeout)
        # shorthand is recent).
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        if wait_forever:
            opts.timeout = FOREVER
        self._pg.broadcast([x], opts).wait()
        return x

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._pg.allreduce([t], opts).wait()
        return int(t.item())

    def close(self, *, abort: bool = False) -> None:
        """Release the communicator: `shutdown` (NCCL flushes, then destroys: every rank of
        the host must call it, at about the same time) or, with `abort` (a peer is gone),
        `abort`, which waits on no one. Either is bounded by CLOSE_TIMEOUT_S: past it this
        rank logs and moves on (its process's exit releases the rest)."""
        if self._closed:
            return
        self._closed = True
        peer = getattr(self, "_peer", None)
        if peer is not None:
            self._peer = None
            peer.close()
        # NOTE: a group that failed to form has no backend to release; older torch releases
        # name the method with a leading underscore.
        backend = getattr(self, "_pg", None)
        name = "abort" if abort else "shutdown"
        release = getattr(backend, name, None) or getattr(backend, f"_{name}", None)
        if release is None:
            return

        def run() -> None:
            # NOTE: a peer already gone leaves nothing to release cleanly.
            with contextlib.suppress(RuntimeError):
                release()

        helper = threading.Thread(target=run, daemon=True, name="tp-close")
        helper.start()
        helper.join(CLOSE_TIMEOUT_S)
        if helper.is_alive():
            log.warning(
                "tensor-parallel rank %d: the %s communicator was not released within %.0f s",
                self.rank,
                self.backend,
                CLOSE_TIMEOUT_S,
            )
