"""Where a request is while the gateway drives it across workers (`Route`: what `abort` must
reach, and under which id the decode worker knows it), and how long it has left (`remaining`).
The orchestrator, the Reserve hedge (`hedge.py`) and stream migration (`migration.py`) share
them."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from splitserve.engine.errors import DeadlineExceeded
from splitserve.kv_transfer.registry import WorkerInfo


class Pick(NamedTuple):
    """A decode worker picked for a request (counted in flight for it), the prompt's leading
    blocks it holds, and every worker's cached leading blocks as the registry saw them then
    (a host-tier block weighted below a GPU one: `router.prefix_scores`)."""

    worker: WorkerInfo
    prefix_blocks: int
    cached_blocks: Mapping[str, float]


@dataclass
class Route:
    """Where a request is, so that `abort` can reach it."""

    decode: WorkerInfo
    prefill: WorkerInfo | None = None
    prefix_blocks: int = 0  # leading prompt blocks D holds (the registry's view when picked)
    worker_request_id: str | None = None  # the request's id on `decode`, once a stream moved
    calls: list[Any] = field(default_factory=list)  # cancellable futures / streams
    cancelled: bool = False
    reserving: bool = False  # a Reserve was sent: D may hold blocks for the request
    hedges: int = 0  # Reserves sent under an id of their own (gateway/hedge.py)
    # each worker's cached leading prompt blocks when `decode` was picked (`Pick.cached_blocks`)
    cached_blocks: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def picked(cls, pick: Pick) -> Route:
        return cls(pick.worker, prefix_blocks=pick.prefix_blocks, cached_blocks=pick.cached_blocks)

    def move_to(self, pick: Pick) -> None:
        """Point at another decode worker (the caller releases the old one's count)."""
        self.decode, self.prefix_blocks, self.cached_blocks = pick

    def new_attempt_id(self, request_id: str) -> str:
        """An id of its own for another Reserve of `request_id`: what a worker grants under an
        earlier one (late, or to a hedge's loser) is aborted under that id, never meets this."""
        self.hedges += 1
        return f"{request_id}~h{self.hedges}"


def remaining(deadline: float) -> float:
    """Seconds until `deadline` (a `time.monotonic()` value); DeadlineExceeded once passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return left
