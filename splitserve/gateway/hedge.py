"""A Reserve that does not wait on a frozen decode worker: hedged, with a paced deadline.

    gateway ──Reserve(id)────────▶ D1   (no answer within `reserve_hedge_s`)
            ──Reserve(id~h1)─────▶ D2   the hedge: another live decode worker (not suspect,
                                        unless every other one is)
            ◀── first success wins; the other call is cancelled and aborted on its worker

The hedge delay is paced by the first worker's recent Reserve answers (the ones it won:
`runtime/pace.py`, HEDGE_FACTOR, at most HEDGE_CAP_S) and counts from when it was last heard
from, so busy workers are not all asked twice at full load; a frozen one is hedged
`reserve_hedge_s` (1 s at most) after its last answer. The request goes on with whichever
worker answered first (under the id that worker holds it by: each attempt has an id of its own,
so an abort of the loser never meets a later attempt on the same worker). The loser's
reservation, if the worker grants it after all, is freed: its call is cancelled (a worker
undoes a Reserve whose caller went away) and it is aborted in the background (a worker that had
answered before the cancel reached it). A worker is *suspect* only when a Reserve to it misses
its suspicion deadline, `reserve_timeout_s` paced by the worker's recent answers and stream
gaps (`runtime/pace.py`), never for being slower than the hedge; a loser cancelled before its
deadline is not judged. A suspect worker that answers a Reserve in time is no longer suspect.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from splitserve.engine.errors import DeadlineExceeded
from splitserve.gateway.observability import RESERVE, RequestObservation
from splitserve.gateway.route import Route
from splitserve.gateway.router import NoWorkerError
from splitserve.gateway.validation import Job
from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.protos.v1 import worker_pb2
from splitserve.runtime.pace import CAP_FACTOR

if TYPE_CHECKING:
    from splitserve.gateway.orchestrator import Orchestrator

log = logging.getLogger(__name__)


@dataclass
class _Attempt:
    worker: WorkerInfo
    request_id: str
    task: asyncio.Future[worker_pb2.KVDestination]
    sent: float
    prefix_blocks: int = 0
    timed_out: bool = False  # it missed its suspicion deadline (its worker is suspect)
    answered: float = 0.0  # when its call ended

    @property
    def succeeded(self) -> bool:
        task = self.task
        return task.done() and not task.cancelled() and task.exception() is None

    @property
    def failed(self) -> bool:
        task = self.task
        return task.done() and (task.cancelled() or task.exception() is not None)


async def hedged_reserve(
    orch: Orchestrator,
    job: Job,
    route: Route,
    request: worker_pb2.ReserveRequest,
    deadline: float,
    obs: RequestObservation,
    refused: set[str],
) -> worker_pb2.KVDestination:
    """Reserve `request` on `route.decode`, hedged on another decode worker (see the module
    doc); on success `route` points at the worker that answered. Raises the first worker's
    error when no attempt succeeds: DEADLINE_EXCEEDED when it missed its suspicion deadline
    (it is then suspect). `refused`: workers not to hedge on."""
    settings = orch.settings.failover
    floor_s = settings.reserve_timeout_s
    attempts = [_send(orch, route.decode, request, deadline, obs, route.prefix_blocks)]
    hedge_at = delay_s = math.inf
    if settings.reserve_hedge_s:
        delay_s = orch.reserve_paces.hedge_delay(route.decode.worker_id, settings.reserve_hedge_s)
        hedge_at = attempts[0].sent + delay_s
    winner: _Attempt | None = None
    try:
        while winner is None:
            winner = next((a for a in attempts if a.succeeded and not a.timed_out), None)
            if winner is not None:
                break
            pending = [a for a in attempts if not (a.task.done() or a.timed_out)]
            if not pending:
                raise _error(attempts[0])
            now = time.monotonic()
            for a in pending:
                due_s = orch.paces.deadline(a.worker.worker_id, floor_s)
                if now - a.sent >= due_s:
                    a.timed_out = True
                    a.task.cancel()
                    _release(orch, a)
                    orch.suspects.mark(
                        a.worker.worker_id, f"no answer to Reserve in {due_s:.1f} s", "reserve"
                    )
            # NOTE: the delay counts from when the first worker was last heard from: one that
            # answers other calls meanwhile is busy, not frozen
            heard = orch.paces.last_heard(attempts[0].worker.worker_id)
            if now >= hedge_at and heard > attempts[0].sent and heard + delay_s > now:
                hedge_at = heard + delay_s
            if now >= hedge_at:
                hedge_at = math.inf  # NOTE: one hedge per round
                hedge = await _hedge(orch, job, route, request, deadline, obs, refused, attempts)
                if hedge is not None:
                    attempts.append(hedge)
            pending = [a for a in attempts if not (a.task.done() or a.timed_out)]
            if not pending:
                continue
            wake = min(
                [hedge_at]
                + [a.sent + orch.paces.deadline(a.worker.worker_id, floor_s) for a in pending]
            )
            await asyncio.wait(
                [a.task for a in pending],
                timeout=max(0.0, wake - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
    finally:
        for a in attempts:
            if a is not winner and not a.timed_out and not a.failed:
                a.task.cancel()
                _release(orch, a)
        for a in attempts[1:]:
            if a is not winner:
                orch._count(a.worker.worker_id, -1)  # NOTE: a hedge's worker came counted
    answered_s = winner.answered - winner.sent
    orch.suspects.clear(winner.worker.worker_id)
    orch.paces.observe(winner.worker.worker_id, answered_s)
    orch.reserve_paces.observe(winner.worker.worker_id, answered_s)
    if winner is not attempts[0]:
        previous = route.decode
        route.decode, route.prefix_blocks = winner.worker, winner.prefix_blocks
        route.worker_request_id = winner.request_id
        orch._count(previous.worker_id, -1)
        log.info(
            "Reserve of %s: %s answered the hedge before %s",
            winner.request_id, winner.worker.worker_id, previous.worker_id,
        )  # fmt: skip
    return winner.task.result()


def _send(
    orch: Orchestrator,
    worker: WorkerInfo,
    request: worker_pb2.ReserveRequest,
    deadline: float,
    obs: RequestObservation,
    prefix_blocks: int,
) -> _Attempt:
    # NOTE: the call's own timeout only bounds it: the paced deadline (at most CAP_FACTOR times
    # the floor) is kept by `hedged_reserve`, which cancels the call when it passes.
    longest = CAP_FACTOR * orch.settings.failover.reserve_timeout_s
    # NOTE: the worker's own pace, for a gateway that has not waited on it yet (runtime/pace.py)
    orch.paces.advertise(worker.worker_id, worker.pace_ms / 1000)
    orch.reserve_paces.advertise(worker.worker_id, worker.pace_ms / 1000)

    async def call() -> worker_pb2.KVDestination:
        with obs.call(RESERVE, worker) as span:
            reply = await orch.stubs.decode(worker.address).Reserve(
                request, timeout=min(_remaining(deadline), longest), metadata=span.metadata
            )
            return reply.destination

    attempt = _Attempt(
        worker, request.request_id, asyncio.ensure_future(call()), time.monotonic(), prefix_blocks
    )

    def ended(task: asyncio.Future[worker_pb2.KVDestination]) -> None:
        attempt.answered = time.monotonic()
        if not task.cancelled() and task.exception() is None:
            orch.paces.heard(worker.worker_id)
        # NOTE: a loser's error is nobody's to raise: asyncio won't log it once retrieved above

    attempt.task.add_done_callback(ended)
    return attempt


async def _hedge(
    orch: Orchestrator,
    job: Job,
    route: Route,
    request: worker_pb2.ReserveRequest,
    deadline: float,
    obs: RequestObservation,
    refused: set[str],
    attempts: list[_Attempt],
) -> _Attempt | None:
    """The same Reserve, under an id of its own, on another live decode worker: one not
    suspect, else a suspect one (it may have missed a deadline only because it was busy: better
    than waiting on one that does not answer); None if there is none."""
    tried = refused | {a.worker.worker_id for a in attempts}
    try:
        worker, hit, _ = await orch._pick_decode(job, obs, tried, "hedge")
    except NoWorkerError:
        return None
    except Exception:  # noqa: BLE001 - Redis unreachable: no hedge, the first attempt goes on
        log.debug("no hedge for the Reserve of %s", request.request_id, exc_info=True)
        return None
    hedged = worker_pb2.ReserveRequest()
    hedged.CopyFrom(request)
    hedged.request_id = route.new_attempt_id(job.request_id)
    return _send(orch, worker, hedged, deadline, obs, hit)


def _release(orch: Orchestrator, attempt: _Attempt) -> None:
    """Free what a losing attempt may hold (see the module doc)."""
    orch.mover.abort_in_background(attempt.worker, attempt.request_id)


def _error(first: _Attempt) -> BaseException:
    if first.timed_out or first.task.cancelled():
        return grpc.aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=f"decode worker {first.worker.worker_id} did not answer Reserve in time",
        )
    error = first.task.exception()
    assert error is not None
    return error


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return remaining
