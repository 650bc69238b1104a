"""Choosing workers. Policies sit behind `RoutingPolicy`; `make_policy` builds one by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

from splitserve.engine.errors import Unavailable
from splitserve.kv_transfer.registry import WorkerInfo


class NoWorkerError(Unavailable):
    """No live worker of the needed kind (the gateway answers UNAVAILABLE)."""


def prefix_scores(
    tiers: Mapping[str, tuple[int, int]], host_block_weight: float
) -> dict[str, float]:
    """Each worker's cached prefix in GPU-block equivalents, from `Registry.prefix_match_tiers`
    ((GPU blocks, GPU-or-host blocks) per worker): a block in a worker's host tier counts
    `host_block_weight` of one on its GPU, since it is copied back rather than recomputed.

    NOTE: the default weight, 0.9: on an H100, loading a 32k-token prefix from host memory took
    about 7% of the time of recomputing it, so a host block saves ~0.9 of a GPU block's work.
    """
    return {w: gpu + host_block_weight * (either - gpu) for w, (gpu, either) in tiers.items()}


class RoutingPolicy(ABC):
    @abstractmethod
    def pick_decode(
        self,
        workers: Sequence[WorkerInfo],
        inflight: Mapping[str, int],
        prefix_blocks: Mapping[str, float],
    ) -> WorkerInfo:
        """The decode worker for a request; `prefix_blocks[w]` is how many of the prompt's
        leading blocks worker w already caches (a host-tier block weighted below a GPU one:
        `prefix_scores`), `inflight[w]` what this gateway sent it."""

    @abstractmethod
    def pick_prefill(
        self,
        workers: Sequence[WorkerInfo],
        queued_tokens: Mapping[str, int],
        cached_tokens: Mapping[str, float] | None = None,
    ) -> WorkerInfo:
        """The prefill worker for a request; `queued_tokens[w]` is the prompt tokens this
        gateway has given worker w that it has not finished (its prefill queue),
        `cached_tokens[w]` how many of the prompt's leading tokens w already caches (weighted
        as `prefix_blocks` is)."""


class LeastLoadedPrefixAware(RoutingPolicy):
    """Decode: least loaded wins (running, waiting and reserved requests, or what this gateway
    sent it, whichever is more); each cached prefix block takes `prefix_weight` requests off its
    load, since it saves that much transfer and compute; among equals, the most free KV blocks.
    Prefill: the least work before this prompt's first token, in tokens: what is queued on the
    worker plus what of this prompt it does not cache (a prefix it holds is not computed
    again), as Dynamo's KV router weighs overlap against load."""

    def __init__(self, prefix_weight: float = 0.5) -> None:
        self.prefix_weight = prefix_weight

    def pick_decode(
        self,
        workers: Sequence[WorkerInfo],
        inflight: Mapping[str, int],
        prefix_blocks: Mapping[str, float],
    ) -> WorkerInfo:
        if not workers:
            raise NoWorkerError("no decode worker is alive")

        def score(w: WorkerInfo) -> tuple[float, float, str]:
            load = max(w.load, inflight.get(w.worker_id, 0))
            bonus = self.prefix_weight * prefix_blocks.get(w.worker_id, 0)
            used = 1.0 - w.num_free_blocks / w.num_total_blocks if w.num_total_blocks else 0.0
            return load - bonus, used, w.worker_id

        return min(workers, key=score)

    def pick_prefill(
        self,
        workers: Sequence[WorkerInfo],
        queued_tokens: Mapping[str, int],
        cached_tokens: Mapping[str, float] | None = None,
    ) -> WorkerInfo:
        if not workers:
            raise NoWorkerError("no prefill worker is alive")
        cached = cached_tokens or {}

        def work(w: WorkerInfo) -> tuple[float, str]:
            return queued_tokens.get(w.worker_id, 0) - cached.get(w.worker_id, 0), w.worker_id

        return min(workers, key=work)


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "least-loaded-prefix": LeastLoadedPrefixAware,
}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; available: {sorted(POLICIES)}")
    return POLICIES[name]()
