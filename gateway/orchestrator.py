"""Drives one request across workers: Reserve on D, Prefill on P (pushing KV to D), Decode on D.

    gateway ──Reserve──▶ D   (blocks held, prefix reused, lease + fence in Redis)
            ──Prefill──▶ P ──PushBlocks──▶ D    (returns the first token once D has all KV)
            ──Decode───▶ D ══ tokens ══▶ gateway ══▶ client

A prefill worker that fails (dies, or loses its lease) is retried once on another, with a fresh
reservation; a decode worker that refuses the reservation (UNAVAILABLE: it is draining or still
loading) is replaced once by another. Every in-flight call is cancellable from `abort`, so a
cancel at the client reaches P and D and frees their blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.engine.errors import AlreadyExists, Cancelled, DeadlineExceeded
from splitserve.engine.prefix_hash import prefix_block_hashes
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


@dataclass
class Route:
    """Where a request is, so that `abort` can reach it."""

    decode: WorkerInfo
    prefill: WorkerInfo | None = None
    calls: list[Any] = field(default_factory=list)  # cancellable futures / streams
    cancelled: bool = False


class Stubs:
    """One channel per worker address, shared by all requests."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address)
            return self._channels[address]

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(address))

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(address))

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


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

    def run(
        self,
        job: Job,
        timeout_s: float | None,
        is_active: Callable[[], bool],
        obs: RequestObservation,
    ) -> Generator[worker_pb2.DecodeResponse, None, None]:
        """Yield the decode worker's stream for `job`; raise grpc.RpcError / NoWorkerError."""
        deadline = time.monotonic() + (timeout_s or self.settings.default_timeout_s)
        route = Route(self._pick_decode(job, obs, exclude=()))
        with self._lock:
            if job.request_id in self._routes:
                raise AlreadyExists(f"request id {job.request_id!r} is already running")
            self._routes[job.request_id] = route
        self._count(route.decode.worker_id, +1)
        try:
            first = self._prefill(job, route, deadline, is_active, obs)
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
                yield from stream
        finally:
            with self._lock:
                self._routes.pop(job.request_id, None)
            self._count(route.decode.worker_id, -1)

    def _pick_decode(
        self, job: Job, obs: RequestObservation, exclude: Collection[str]
    ) -> WorkerInfo:
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
        hit = bool(prefix.get(chosen.worker_id))
        obs.routed("decode", chosen.worker_id, "prefix_hit" if hit else "least_loaded")
        return chosen

    def _reserve(
        self, job: Job, route: Route, deadline: float, obs: RequestObservation
    ) -> worker_pb2.KVDestination:
        """Blocks on D for the prompt; a D that refuses (draining) is replaced once."""
        request = worker_pb2.ReserveRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            sampling=convert.sampling_to_proto(job.params),
        )
        for attempt in range(2):
            try:
                with obs.call(RESERVE, route.decode) as call:
                    stub = self.stubs.decode(route.decode.address)
                    reply = stub.Reserve(
                        request, timeout=_remaining(deadline), metadata=call.metadata
                    )
                    return reply.destination
            except grpc.RpcError as err:
                if attempt or err.code() != grpc.StatusCode.UNAVAILABLE or route.cancelled:
                    raise
                refused = route.decode
                route.decode = self._pick_decode(job, obs, exclude={refused.worker_id})
                self._count(refused.worker_id, -1)
                self._count(route.decode.worker_id, +1)
        raise AssertionError("unreachable")  # pragma: no cover

    def _prefill(
        self,
        job: Job,
        route: Route,
        deadline: float,
        is_active: Callable[[], bool],
        obs: RequestObservation,
    ) -> list[worker_pb2.FirstToken]:
        """Reserve on D and, unless D prefills itself, run the prefill on some P."""
        tried: set[str] = set()
        sampling = convert.sampling_to_proto(job.params)
        for attempt in range(self.settings.prefill_attempts):
            dest = self._reserve(job, route, deadline, obs)
            uncached = len(job.prompt_token_ids) - dest.num_cached_tokens
            if route.decode.kind == "colocated" or uncached <= self.settings.local_prefill_tokens:
                obs.routed("prefill", route.decode.worker_id, "local")
                return []
            candidates = [
                w
                for w in self._matching(self.registry.live_workers("prefill"))
                if w.worker_id not in tried
            ]
            try:
                prefill = self.policy.pick_prefill(candidates, self._inflight_snapshot())
            except NoWorkerError:
                self._abort_reservation(route, job.request_id)
                raise
            route.prefill = prefill
            tried.add(prefill.worker_id)
            obs.routed("prefill", prefill.worker_id, "retry" if attempt else "least_loaded")
            with obs.call(PREFILL, prefill) as call:
                future = self.stubs.prefill(prefill.address).Prefill.future(
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
                self._track(route, future)
                self._count(prefill.worker_id, +1)
                try:
                    response = future.result()
                    obs.prefilled(response)
                    return list(response.first_tokens)
                except grpc.FutureCancelledError:
                    raise Cancelled(f"request {job.request_id!r} was cancelled") from None
                except grpc.RpcError as err:
                    call.fail(err)
                    self._abort_reservation(route, job.request_id)
                    retry = attempt + 1 < self.settings.prefill_attempts
                    if not (
                        retry and err.code() in RETRYABLE and is_active() and not route.cancelled
                    ):
                        raise
                    log.warning(
                        "prefill of %s on %s failed (%s); retrying elsewhere",
                        job.request_id,
                        prefill.worker_id,
                        err.code(),
                    )
                finally:
                    self._count(prefill.worker_id, -1)
        raise AssertionError("unreachable")  # pragma: no cover

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

    def abort(self, request_id: str) -> bool:
        """Cancel a running request on every worker it touches; False if it is not running."""
        with self._lock:
            route = self._routes.get(request_id)
        if route is None:
            return False
        route.cancelled = True
        for call in list(route.calls):
            call.cancel()
        self._abort_reservation(route, request_id)
        return True

    def _abort_reservation(self, route: Route, request_id: str) -> None:
        try:
            self.stubs.decode(route.decode.address).Abort(
                common_pb2.AbortRequest(request_id=request_id), timeout=5.0
            )
        except grpc.RpcError as err:
            log.warning("abort of %s on %s failed: %s", request_id, route.decode.worker_id, err)

    def _track(self, route: Route, call: Any) -> None:
        route.calls.append(call)
        if route.cancelled:
            call.cancel()

    def _inflight_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._inflight)

    def close(self) -> None:
        self.stubs.close()


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return remaining
