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
another. A cancel (the client went away, or `Abort`: see `requests.py`) reaches P and D through
the request's own route and frees their blocks, whatever the stage.

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
from collections.abc import AsyncGenerator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from splitserve.engine.errors import quoted
from splitserve.engine.prefix_hash import prefix_block_hashes
from splitserve.gateway.admission import PrefillBudget
from splitserve.gateway.failover import FailoverSettings, Suspects
from splitserve.gateway.hedge import hedged_reserve
from splitserve.gateway.migration import StreamMover
from splitserve.gateway.observability import PREFILL, RequestObservation
from splitserve.gateway.prefill_ledger import PrefillLedger
from splitserve.gateway.prefix_follower import PrefixFollower
from splitserve.gateway.route import Pick, Route, remaining
from splitserve.gateway.router import NoWorkerError, RoutingPolicy, prefix_scores
from splitserve.gateway.stubs import Stubs
from splitserve.gateway.validation import Job
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.registry_records import can_transfer
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2
from splitserve.runtime.pace import Paces

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
    # What a block in a worker's host-memory KV tier counts for in routing, a GPU block's 1
    host_block_weight: float = 0.9
    # Prompts with at most this many tokens not cached on D are prefilled on D itself.
    local_prefill_tokens: int = 0
    prefill_attempts: int = 2
    default_timeout_s: float = 600.0
    # Prompt tokens given to one prefill worker at once; the rest wait in the gateway.
    max_prefill_tokens_per_worker: int = 16384
    reserve_backoff_s: tuple[float, float] = (0.02, 0.5)  # first and longest wait when D is full
    failover: FailoverSettings = FailoverSettings()  # deadlines, moving streams off lost workers


class Orchestrator:
    def __init__(
        self,
        registry: Registry,
        policy: RoutingPolicy,
        settings: OrchestratorSettings,
        stubs: Stubs | None = None,
        ledger: PrefillLedger | None = None,
        prefix_index: PrefixFollower | None = None,
    ) -> None:
        """`ledger`: where prefill budgets are counted (default: this process only);
        `prefix_index`: the registry's prefix index followed in memory (routing asks Redis
        whenever it is not in step, or without one)."""
        self.prefix_index = prefix_index
        self.registry = registry
        self.policy = policy
        self.settings = settings
        self.stubs = stubs or Stubs()  # the channels to the workers (with the cluster secret)
        self._inflight: dict[str, int] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.budget = PrefillBudget(settings.max_prefill_tokens_per_worker, ledger=ledger)
        self.suspects = Suspects(settings.failover.suspect_s)
        # NOTE: each decode worker's recent waits (Reserve answers, stream gaps): its deadlines
        self.paces = Paces()
        self.reserve_paces = Paces()  # Reserve answers only: the hedge's pace (hedge.py)
        self.mover = StreamMover(self, settings.failover)

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
        route = Route.picked(await self._pick_decode(job, obs, exclude=()))
        try:
            first = await self._prefill(job, route, deadline, is_active, obs)
            async for msg in self.mover.stream(job, route, first, deadline, obs):
                yield msg
        except (asyncio.CancelledError, GeneratorExit):
            # NOTE: the caller went away or aborted (cancelled, deadline passed, or closed the
            # stream): its P and D calls are cancelled and D's blocks freed, even if cancelled
            # again. Only this route's: the id is this request's alone while it runs.
            await asyncio.shield(self._release(route, job.request_id))
            raise
        except BaseException:
            for call in list(route.calls):
                call.cancel()  # NOTE: a call still open would hold its worker's request
            raise
        finally:
            self._count(route.decode.worker_id, -1)

    async def _pick_decode(
        self,
        job: Job,
        obs: RequestObservation,
        exclude: Collection[str],
        reason: str | None = None,
    ) -> Pick:
        """The decode worker for `job`, a suspect one only if no other is live. It comes
        counted in flight: the caller releases it with `_count(worker_id, -1)`."""
        # NOTE: in a thread: the registry is a blocking Redis client.
        avoid = self.suspects.current() | set(exclude)
        try:
            return await asyncio.to_thread(self._pick_decode_now, job, obs, avoid, reason)
        except NoWorkerError:
            if avoid == set(exclude):
                raise
            return await asyncio.to_thread(self._pick_decode_now, job, obs, exclude, reason)

    def _pick_decode_now(
        self,
        job: Job,
        obs: RequestObservation,
        exclude: Collection[str],
        reason: str | None = None,
    ) -> Pick:
        workers = [
            w
            for kind in ("decode", "colocated")
            for w in self._matching(self.registry.live_workers(kind), job.adapter)
            if w.worker_id not in exclude
        ]
        # NOTE: a LoRA request's blocks are keyed by its adapter's weights, which the gateway
        # does not know: no prefix bonus (its affinity is the adapter itself).
        tiers = self._prefix_tiers(job.prompt_token_ids) if job.adapter is None else {}
        prefix = prefix_scores(tiers, self.settings.host_block_weight)
        # NOTE: picked and counted under one lock: a burst of picks running in threads at once
        # must each see the ones before it, or they all pick the same least-loaded worker.
        with self._lock:
            chosen = self.policy.pick_decode(workers, self._inflight, prefix)
            self._inflight[chosen.worker_id] = self._inflight.get(chosen.worker_id, 0) + 1
        # NOTE: blocks in either tier: D computes none of them again (host ones are copied back)
        hit = tiers.get(chosen.worker_id, (0, 0))[1]
        obs.routed("decode", chosen.worker_id, reason or ("prefix_hit" if hit else "least_loaded"))
        return Pick(chosen, hit, prefix)

    def _prefix_tiers(self, prompt: Sequence[int]) -> dict[str, tuple[int, int]]:
        """Each worker's (GPU run, reusable run) of the prompt's leading blocks: from memory,
        hashing only as far as some worker's run goes (prefix_view.py), else from Redis."""
        bs = self.settings.block_size
        if self.prefix_index is not None:
            tiers = self.prefix_index.match_tiers(prompt, bs)
            if tiers is not None:
                return tiers
        hashes = prefix_block_hashes(prompt, bs)
        return self.registry.prefix_match_tiers(hashes) if hashes else {}

    async def _reserve(
        self,
        job: Job,
        route: Route,
        deadline: float,
        obs: RequestObservation,
        resume: worker_pb2.ResumeFrom | None = None,
    ) -> worker_pb2.KVDestination:
        """Blocks on D for the prompt. A D slow to answer is hedged on another (`hedge.py`); a
        D that refuses (draining) or does not answer by its deadline (`reserve_timeout_s`,
        paced: marked suspect) is replaced by another (one that did not answer is asked again,
        under a fresh id, when no other is live); one whose pool is full is asked again
        (another D may be picked) with back-off until the deadline, so the request waits for
        memory."""
        request = worker_pb2.ReserveRequest(
            request_id=route.worker_request_id or job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            sampling=convert.sampling_to_proto(job.params),
            resume=resume,
            adapter=job.adapter or "",
        )
        wait, longest = self.settings.reserve_backoff_s
        refused: set[str] = set()
        route.reserving = True
        while True:
            try:
                return await hedged_reserve(self, job, route, request, deadline, obs, refused)
            except grpc.RpcError as err:
                full = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                silent = err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                draining = silent or err.code() == grpc.StatusCode.UNAVAILABLE
                if route.cancelled or not (full or draining):
                    raise
                if silent:
                    # NOTE: its late answer, if any, is aborted under the old id (hedge.py)
                    route.worker_request_id = route.new_attempt_id(job.request_id)
                    request.request_id = route.worker_request_id
                if draining:
                    refused.add(route.decode.worker_id)
                else:
                    await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                    wait = min(longest, wait * 1.5)
                remaining(deadline)
                previous = route.decode
                try:
                    picked = await self._pick_decode(job, obs, exclude=refused)
                except NoWorkerError:
                    if not silent:
                        raise err from None
                    # NOTE: slow, not gone (it is still live): with no other to ask, ask it again
                    refused.discard(previous.worker_id)
                    picked = await self._pick_decode(job, obs, exclude=refused)
                route.move_to(picked)
                self._count(previous.worker_id, -1)

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
        # NOTE: the registry's view from when D was picked: the prompt is hashed and looked up
        # once per request, not once per role.
        bs = self.settings.block_size
        cached = {w: n * bs for w, n in route.cached_blocks.items()}
        for attempt in range(self.settings.prefill_attempts):

            async def candidates() -> list[WorkerInfo]:
                live = await asyncio.to_thread(self.registry.live_workers, "prefill")
                return [
                    w
                    for w in self._matching(live, job.adapter)
                    if w.worker_id not in gone and can_transfer(w, route.decode)
                ]

            def pick(workers: Sequence[WorkerInfo], queued: Mapping[str, int]) -> WorkerInfo:
                return self.policy.pick_prefill(workers, queued, cached)

            # NOTE: the gateway queue comes first: no reservation (and no lease) while waiting.
            prefill = await self.budget.acquire(candidates, uncached, deadline, pick)
            dest = None
            try:
                dest = await self._reserve(job, route, deadline, obs)
                route.prefill = prefill
                obs.routed("prefill", prefill.worker_id, "retry" if attempt else "least_loaded")
                first = await self._prefill_on(job, route, prefill, dest, sampling, deadline, obs)
                return first
            except grpc.RpcError as err:
                # NOTE: a Reserve that failed left nothing on D. One that D can't undo (D is
                # gone) leaves its record until the lease ends: the next try takes a new id.
                if dest is not None and not await self._abort_reservation(route, job.request_id):
                    route.worker_request_id = f"{job.request_id}~r{attempt + 1}"
                retry = attempt + 1 < self.settings.prefill_attempts
                if not (retry and err.code() in RETRYABLE and is_active() and not route.cancelled):
                    raise
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    gone.add(prefill.worker_id)  # dead or draining: try another
                log.warning(
                    "prefill of %s on %s failed (%s: %s); retrying with a fresh reservation",
                    quoted(job.request_id), prefill.worker_id, err.code().name,
                    quoted(err.details(), 200),
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
                    request_id=route.worker_request_id or job.request_id,
                    prompt_token_ids=job.prompt_token_ids,
                    sampling=sampling,
                    destination=dest,
                    priority=job.priority,
                    adapter=job.adapter or "",
                ),
                timeout=remaining(deadline),
                metadata=call.metadata,
            )
            self._track(route, rpc)
            self._count(prefill.worker_id, +1)
            try:
                response = await self.mover.prefill_guarded(rpc, route.decode)
            except grpc.RpcError as err:
                call.fail(err)
                raise
            finally:
                self._count(prefill.worker_id, -1)
            obs.prefilled(response)
            return list(response.first_tokens)

    def _matching(self, workers: list[WorkerInfo], adapter: str | None = None) -> list[WorkerInfo]:
        """Workers whose KV block size is the gateway's (the others are logged and skipped)
        and that serve `adapter`, if the request names one (LoRA affinity)."""
        if adapter is not None:
            workers = [w for w in workers if adapter in w.adapters]
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

    async def _release(self, route: Route, request_id: str) -> None:
        """Cancel the calls of this route on every worker it reached, and free what D holds."""
        route.cancelled = True
        for call in list(route.calls):
            call.cancel()
        if route.reserving:
            await self._abort_reservation(route, route.worker_request_id or request_id)

    async def _abort_reservation(self, route: Route, request_id: str) -> bool:
        """Abort the request on D; False if D did not answer."""
        try:
            await self.stubs.decode(route.decode.address).Abort(
                common_pb2.AbortRequest(request_id=route.worker_request_id or request_id),
                timeout=self.settings.failover.rpc_timeout_s,
            )
            return True
        except grpc.RpcError as err:
            log.warning(
                "abort of %s on %s failed: %s",
                quoted(request_id),
                route.decode.worker_id,
                quoted(err.details(), 200),
            )
            return False

    def _track(self, route: Route, call: Any) -> None:
        route.calls.append(call)
        if route.cancelled:
            call.cancel()

    async def close(self) -> None:
        """Close the channels to the workers (on the server's event loop)."""
        await self.stubs.close()
