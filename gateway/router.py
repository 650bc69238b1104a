"""Choosing workers. Policies sit behind `RoutingPolicy`; `make_policy` builds one by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

from splitserve.engine.errors import Unavailable
from splitserve.kv_transfer.registry import WorkerInfo


class NoWorkerError(Unavailable):
    """No live worker of the needed kind (the gateway answers UNAVAILABLE)."""


class RoutingPolicy(ABC):
    @abstractmethod
    def pick_decode(
        self,
        workers: Sequence[WorkerInfo],
        inflight: Mapping[str, int],
        prefix_blocks: Mapping[str, int],
    ) -> WorkerInfo:
        """The decode worker for a request; `prefix_blocks[w]` is how many of the prompt's
        leading blocks worker w already caches, `inflight[w]` what this gateway sent it."""

    @abstractmethod
    def pick_prefill(
        self, workers: Sequence[WorkerInfo], inflight: Mapping[str, int]
    ) -> WorkerInfo:
        """The prefill worker for a request."""


class LeastLoadedPrefixAware(RoutingPolicy):
    """Least loaded wins; each cached prefix block takes `prefix_weight` requests off a decode
    worker's load, since it saves that much transfer and compute."""

    def __init__(self, prefix_weight: float = 0.5) -> None:
        self.prefix_weight = prefix_weight

    def pick_decode(
        self,
        workers: Sequence[WorkerInfo],
        inflight: Mapping[str, int],
        prefix_blocks: Mapping[str, int],
    ) -> WorkerInfo:
        if not workers:
            raise NoWorkerError("no decode worker is alive")

        def score(w: WorkerInfo) -> tuple[float, str]:
            load = max(w.load, inflight.get(w.worker_id, 0))
            return load - self.prefix_weight * prefix_blocks.get(w.worker_id, 0), w.worker_id

        return min(workers, key=score)

    def pick_prefill(
        self, workers: Sequence[WorkerInfo], inflight: Mapping[str, int]
    ) -> WorkerInfo:
        if not workers:
            raise NoWorkerError("no prefill worker is alive")
        return min(workers, key=lambda w: (max(w.load, inflight.get(w.worker_id, 0)), w.worker_id))


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "least-loaded-prefix": LeastLoadedPrefixAware,
}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; available: {sorted(POLICIES)}")
    return POLICIES[name]()
