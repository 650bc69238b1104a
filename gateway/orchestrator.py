"""Drives one request across workers: Reserve on D, Prefill on P (pushing KV to D), Decode on D.

    gateway ──Reserve──▶ D   (blocks held, prefix reused, lease + fence in Redis)
            ──Prefill──▶ P ──PushBlocks──▶ D    (returns the first token once D has all KV)
            ──Decode───▶ D ══ tokens ══▶ gateway ══▶ client

A request that needs a prefill first waits in the gateway (`admission.PrefillBudget`) until a
prefill worker has room for its prompt; only then is its KV reserved on D, so no lease runs while
it queues. A decode worker whose pool is full (RESOURCE_EXHAUSTED) is asked again, with back-off,
until the request's deadline: the request waits rather than fails. A prefill that fails is
retried once with a fresh reservation (on another worker if the first one is gone); a decode
worker that refuses the reservation (UNAVAILABLE: it is draining or still loading) is replaced by
another. Every in-flight call is cancellable from `abort`, so a cancel at the client reaches P
and D and frees their blocks.

It runs on the gateway's event loop: the calls to the workers are `grpc.aio` calls awaited by
the request's task (a waiting request holds no thread), and the registry's blocking Redis reads
run in threads. A client that goes away cancels that task; `run` then aborts the request on
every worker it reached, shielded from further cancels.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.engine.errors import AlreadyExists, Cancelled, DeadlineExceeded
from splitserve.engine.prefix_hash import prefix_block_hashes
from splitserve.gateway.admission import PrefillBudget
from splitserve.gateway.observability import DECODE, PREFILL, RESERVE, RequestObservation
from splitserve.gateway.router import NoWorkerError, RoutingPolicy
from splitserve.gateway.validation import Job
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# A prefill attempt that failed for these reasons may succeed on another worker.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED,
}


@dataclass(frozen=True)
class OrchestratorSettings:
    block_size: int
    # Prompts with at most this many tokens not cached on D are prefilled on D itself.
    local_prefill_tokens: int = 0
    prefill_attempts: int = 2
    default_timeout_s: float = 600.0
    # Prompt tokens given to one prefill worker at once; the rest wait in the gateway.
    max_prefill_tokens_per_worker: int = 16384
    reserve_backoff_s: tuple[float, float] = (0.02, 0.5)  # first and longest wait when D is full


@dataclass
class Route:
    """Where a request is, so that `abort` can reach it."""

    decode: WorkerInfo
    prefill: WorkerInfo | None = None
    prefix_blocks: int = 0  # leading prompt blocks D holds (the registry's view when picked)
    calls: list[Any] = field(default_factory=list)  # cancellable futures / streams
    cancelled: bool = False


class Stubs:
    """One `grpc.aio` channel per worker address, shared by all requests (made and used on the
    server's event loop)."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lock = threading.Lock()

    def channel(self, address: str) -> grpc.aio.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.aio.insecure_channel(address)
            return self._channels[address]

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(address))

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(address))

    async def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            await channel.close()


class Orchestrator:
    def __init__(
        self, registry: Registry, policy: RoutingPolicy, settings: OrchestratorSettings
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.settings = settings
        self.stubs = Stubs()
        self._routes: dict[str, Route] = {}
        self._inflight: dict[str, int] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.budget = PrefillBudget(settings.max_prefill_tokens_per_worker)

    async def run(
        self,
        job: Job,
        timeout_s: float | None,
        is_active: Callable[[], bool],
        obs: RequestObservation,
    ) -> AsyncGenerator[worker_pb2.DecodeResponse, None]:
        """Yield the decode worker's stream for `job`; raise grpc.RpcError / NoWorkerError.

        If the caller goes away (its task is cancelled, or it closes this early), the request is
        aborted on every worker it reached before this returns."""
        deadline = time.monotonic() + (timeout_s or self.settings.default_timeout_s)
        route = Route(*await self._pick_decode(job, obs, exclude=()))
        with self._lock:
            if job.request_id in self._routes:
                raise AlreadyExists(f"request id {job.request_id!r} is already running")
            self._routes[job.request_id] = route
        self._count(route.decode.worker_id, +1)
        try:
            first = await self._prefill(job, route, deadline, is_active, obs)
            with obs.call(DECODE, route.decode) as call:
                stream = self.stubs.decode(route.decode.address).Decode(
                    worker_pb2.DecodeRequest(
                        request_id=job.request_id,
                        sampling=convert.sampling_to_proto(job.params),
                        first_tokens=first,
                        priority=job.priority,
                    ),
                    timeout=_remaining(deadline),
                    metadata=call.metadata,
                )
                self._track(route, stream)
                async with _aborted_as_cancelled(route, job.request_id):
                    async for msg in stream:
                        yield msg
        except (asyncio.CancelledError, GeneratorExit):
            # NOTE: the caller went away (cancelled, deadline passed, or closed the stream):
            # its P and D calls are cancelled and D's blocks freed, even if cancelled again.
            await asyncio.shield(self.abort(job.request_id))
            raise
        except BaseException:
            for call in list(route.calls):
                call.cancel()  # NOTE: a call still open would hold its worker's request
            raise
        finally:
            with self._lock:
                self._routes.pop(job.request_id, None)
            self._count(route.decode.worker_id, -1)

    async def _pick_decode(
        self, job: Job, obs: RequestObservation, exclude: Collection[str]
    ) -> tuple[WorkerInfo, None, int]:
        """(decode worker, no prefill worker yet, prompt blocks it already holds)."""
        # NOTE: in a thread: the registry is a blocking Redis client.
        return await asyncio.to_thread(self._pick_decode_now, job, obs, exclude)

    def _pick_decode_now(
        self, job: Job, obs: RequestObservation, exclude: Collection[str]
    ) -> tuple[WorkerInfo, None, int]:
        workers = [
            w
            for kind in ("decode", "colocated")
            for w in self._matching(self.registry.live_workers(kind))
            if w.worker_id not in exclude
        ]
        hashes = prefix_block_hashes(job.prompt_token_ids, self.settings.block_size)
        prefix = self.registry.prefix_match(hashes) if hashes else {}
        with self._lock:
            inflight = dict(self._inflight)
        chosen = self.policy.pick_decode(workers, inflight, prefix)
        hit = prefix.get(chosen.worker_id, 0)
        obs.routed("decode", chosen.worker_id, "prefix_hit" if hit else "least_loaded")
        return chosen, None, hit

    async def _reserve(
        self, job: Job, route: Route, deadline: float, obs: RequestObservation
    ) -> worker_pb2.KVDestination:
        """Blocks on D for the prompt. A D that refuses (draining) is replaced by another; one
        whose pool is full is asked again (another D may be picked) with back-off until the
        deadline, so the request waits for memory rather than fails."""
        request = worker_pb2.ReserveRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            sampling=convert.sampling_to_proto(job.params),
        )
        wait, longest = self.settings.reserve_backoff_s
        refused: set[str] = set()
        while True:
            try:
                with obs.call(RESERVE, route.decode) as call:
                    stub = self.stubs.decode(route.decode.address)
                    reply = await stub.Reserve(
                        request, timeout=_remaining(deadline), metadata=call.metadata
                    )
                    return reply.destination
            except grpc.RpcError as err:
                full = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                draining = err.code() == grpc.StatusCode.UNAVAILABLE
                if route.cancelled or not (full or draining):
                    raise
                if draining:
                    refused.add(route.decode.worker_id)
                else:
                    await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                    wait = min(longest, wait * 1.5)
                _remaining(deadline)
                previous = route.decode
                try:
                    picked = await self._pick_decode(job, obs, exclude=refused)
                except NoWorkerError:
                    raise err from None
                route.decode, _, route.prefix_blocks = picked
                self._count(previous.worker_id, -1)
                self._count(route.decode.worker_id, +1)

    async def _prefill(
        self,
        job: Job,
        route: Route,
        deadline: float,
        is_active: Callable[[], bool],
        obs: RequestObservation,
    ) -> list[worker_pb2.FirstToken]:
        """Reserve on D and, unless D prefills itself, run the prefill on some P."""
        uncached = len(job.prompt_token_ids) - route.prefix_blocks * self.settings.block_size
        if route.decode.kind == "colocated" or uncached <= self.settings.local_prefill_tokens:
            await self._reserve(job, route, deadline, obs)
            obs.routed("prefill", route.decode.worker_id, "local")
            return []
        gone: set[str] = set()
        sampling = convert.sampling_to_proto(job.params)
        for attempt in range(self.settings.prefill_attempts):

            async def candidates() -> list[WorkerInfo]:
                live = await asyncio.to_thread(self.registry.live_workers, "prefill")
                return [w for w in self._matching(live) if w.worker_id not in gone]

            # NOTE: the gateway queue comes first: no reservation (and no lease) while waiting.
            prefill = await self.budget.acquire(
                candidates, uncached, deadline, self.policy.pick_prefill
            )
            try:
                dest = await self._reserve(job, route, deadline, obs)
                route.prefill = prefill
                obs.routed("prefill", prefill.worker_id, "retry" if attempt else "least_loaded")
                first = await self._prefill_on(job, route, prefill, dest, sampling, deadline, obs)
                return first
            except grpc.RpcError as err:
                await self._abort_reservation(route, job.request_id)
                retry = attempt + 1 < self.settings.prefill_attempts
                if not (retry and err.code() in RETRYABLE and is_active() and not route.cancelled):
                    raise
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    gone.add(prefill.worker_id)  # dead or draining: try another
                log.warning(
                    "prefill of %s on %s failed (%s: %s); retrying with a fresh reservation",
                    job.request_id, prefill.worker_id, err.code().name, err.details(),
                )  # fmt: skip
            finally:
                await self.budget.release(prefill.worker_id, uncached)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _prefill_on(
        self,
        job: Job,
        route: Route,
        prefill: WorkerInfo,
        dest: worker_pb2.KVDestination,
        sampling: Any,
        deadline: float,
        obs: RequestObservation,
    ) -> list[worker_pb2.FirstToken]:
        with obs.call(PREFILL, prefill) as call:
            rpc = self.stubs.prefill(prefill.address).Prefill(
                worker_pb2.PrefillRequest(
                    request_id=job.request_id,
                    prompt_token_ids=job.prompt_token_ids,
                    sampling=sampling,
                    destination=dest,
                    priority=job.priority,
                ),
                timeout=_remaining(deadline),
                metadata=call.metadata,
            )
            self._track(route, rpc)
            self._count(prefill.worker_id, +1)
            try:
                async with _aborted_as_cancelled(route, job.request_id):
                    response = await rpc
            except grpc.RpcError as err:
                call.fail(err)
                raise
            finally:
                self._count(prefill.worker_id, -1)
            obs.prefilled(response)
            return list(response.first_tokens)

    def _matching(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """Workers whose KV block size is the gateway's; the others are logged and skipped."""
        block_size = self.settings.block_size
        odd = [w for w in workers if w.block_size and w.block_size != block_size]
        for w in odd:
            if w.worker_id not in self._warned:
                self._warned.add(w.worker_id)
                log.error(
                    "not routing to %s: its block_size is %d, the gateway's %d",
                    w.worker_id,
                    w.block_size,
                    block_size,
                )
        return [w for w in workers if w not in odd]

    def _count(self, worker_id: str, delta: int) -> None:
        with self._lock:
            self._inflight[worker_id] = self._inflight.get(worker_id, 0) + delta

    async def abort(self, request_id: str) -> bool:
        """Cancel a running request on every worker it touches; False if it is not running."""
        with self._lock:
            route = self._routes.get(request_id)
        if route is None:
            return False
        route.cancelled = True
        for call in list(route.calls):
            call.cancel()
        await self._abort_reservation(route, request_id)
        return True

    async def _abort_reservation(self, route: Route, request_id: str) -> None:
        try:
            await self.stubs.decode(route.decode.address).Abort(
                common_pb2.AbortRequest(request_id=request_id), timeout=5.0
            )
        except grpc.RpcError as err:
            log.warning("abort of %s on %s failed: %s", request_id, route.decode.worker_id, err)

    def _track(self, route: Route, call: Any) -> None:
        route.calls.append(call)
        if route.cancelled:
            call.cancel()

    async def close(self) -> None:
        """Close the channels to the workers (on the server's event loop)."""
        await self.stubs.close()


@asynccontextmanager
async def _aborted_as_cancelled(route: Route, request_id: str) -> AsyncIterator[None]:
    """Turns the end of a call that `abort` cancelled into `Cancelled` (CANCELLED for the
    client). A `grpc.aio` call cancelled locally raises `asyncio.CancelledError` in whoever
    awaits it; that must not pass for a cancel of this task, which grpc does when the client
    goes away."""
    try:
        yield
    except asyncio.CancelledError:
        if route.cancelled and not _cancelling():
            raise Cancelled(f"request {request_id!r} was cancelled") from None
        raise


def _cancelling() -> bool:
    """Whether the current task itself was asked to stop (not just a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return remaining
