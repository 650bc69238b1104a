"""Back-pressure at the gateway: how much prompt each prefill worker is given at once.

A request that needs a prefill waits here, in arrival order, until some live prefill worker has
room for its uncached prompt tokens under `max_tokens_per_worker`; only then is its KV reserved on
a decode worker and its prefill sent. So a long prefill queue builds up in the gateway, where no
reservation's lease runs, instead of on a worker; and the least-busy worker (fewest prompt tokens
in flight) gets the next request.

    request ─▶ wait (FIFO) ─▶ P with room ─▶ Reserve on D ─▶ Prefill on P ─▶ release ─▶ Decode

A prompt longer than the limit still goes, alone, to an idle worker. The tokens are counted in a
`PrefillLedger` (gateway/prefill_ledger.py): in this process, or in Redis across every gateway
replica; there the waiting requests of each replica re-read the counts every `poll_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from splitserve.engine.aio import notified_within
from splitserve.engine.errors import DeadlineExceeded
from splitserve.gateway.prefill_ledger import LocalLedger, PrefillLedger
from splitserve.gateway.router import NoWorkerError
from splitserve.kv_transfer.registry import WorkerInfo

Candidates = Callable[[], Awaitable[Sequence[WorkerInfo]]]
Pick = Callable[[Sequence[WorkerInfo], Mapping[str, int]], WorkerInfo]
T = TypeVar("T")


class PrefillBudget:
    """Prompt tokens in flight per prefill worker, and the requests waiting for room."""

    def __init__(
        self,
        max_tokens_per_worker: int,
        poll_s: float | None = None,
        ledger: PrefillLedger | None = None,
    ) -> None:
        if max_tokens_per_worker < 1:
            raise ValueError("max_tokens_per_worker must be >= 1")
        self.max_tokens_per_worker = max_tokens_per_worker
        self._ledger = ledger or LocalLedger()
        # NOTE: re-read the live workers (and a shared ledger) this often while waiting: other
        # replicas' releases wake nobody here.
        self.poll_s = poll_s if poll_s is not None else (0.05 if self._ledger.blocking else 0.5)
        self._tokens: dict[str, int] = {}  # this process's own, for routing and `tokens()`
        self._changed = asyncio.Condition()
        self._queue: list[object] = []  # waiting requests, in arrival order

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def tokens(self) -> dict[str, int]:
        """Prompt tokens in flight on each prefill worker (what routing ranks them by)."""
        return dict(self._tokens)

    async def acquire(
        self, candidates: Candidates, num_tokens: int, deadline: float, pick: Pick
    ) -> WorkerInfo:
        """The prefill worker this request may use now (`pick` among those with room, given
        their prompt tokens in flight), its tokens counted against it. Waits (first come, first
        served) while every live worker is full; raises NoWorkerError if no prefill worker is
        alive, DeadlineExceeded when `deadline` passes first."""
        ticket = object()
        self._queue.append(ticket)
        try:
            async with self._changed:
                while True:
                    workers = await candidates()
                    if not workers:
                        raise NoWorkerError("no prefill worker is alive")
                    chosen = None
                    if self._queue[0] is ticket:
                        used = await self._call(self._ledger.used, [w.worker_id for w in workers])
                        roomy = self._room(workers, used, num_tokens)
                        chosen = pick(roomy, used) if roomy else None
                    if chosen is not None and await self._call(
                        self._ledger.take, chosen.worker_id, num_tokens, self.max_tokens_per_worker
                    ):
                        self._tokens[chosen.worker_id] = (
                            self._tokens.get(chosen.worker_id, 0) + num_tokens
                        )
                        return chosen
                    if chosen is not None:
                        continue  # NOTE: another replica took the room first: look again
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded(
                            f"the request's deadline passed while it waited for a prefill "
                            f"worker ({len(self._queue)} requests waiting, prompt tokens in "
                            f"flight {self.tokens()})"
                        )
                    await notified_within(self._changed, min(left, self.poll_s))
        finally:
            self._queue.remove(ticket)
            async with self._changed:
                self._changed.notify_all()

    async def release(self, worker_id: str, num_tokens: int) -> None:
        await self._call(self._ledger.give, worker_id, num_tokens)
        left = self._tokens.get(worker_id, 0) - num_tokens
        if left > 0:
            self._tokens[worker_id] = left
        else:
            self._tokens.pop(worker_id, None)
        async with self._changed:
            self._changed.notify_all()

    def _room(
        self, workers: Sequence[WorkerInfo], used: Mapping[str, int], num_tokens: int
    ) -> list[WorkerInfo]:
        """Workers with room for `num_tokens` more (an idle one always has room)."""
        return [
            w
            for w in workers
            if (busy := used.get(w.worker_id, 0)) == 0
            or busy + num_tokens <= self.max_tokens_per_worker
        ]

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        """A ledger call: in a thread if it blocks (Redis)."""
        if self._ledger.blocking:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)
