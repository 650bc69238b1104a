"""The public Gateway service: thin over validation and the orchestrator. Its methods are
coroutines and async generators on the server's event loop: a stream waiting for tokens holds
no thread, so `max_inflight` alone bounds how many run at once. Request ids are claimed in its
`RequestTable` (`requests.py`); `Abort` goes through it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace

import grpc

from splitserve.engine.errors import Overloaded
from splitserve.engine.model_config import ModelConfig
from splitserve.gateway.coalesce import (
    Coalescer,
    check_stream_interval,
    check_stream_interval_ms,
    merge_deltas,
)
from splitserve.gateway.key_limits import PerKeyInflight, PerKeyTokenRate
from splitserve.gateway.limits import AdvertisedLimits, check_adapter, check_job, check_request
from splitserve.gateway.lora_admin import AdapterAdmin
from splitserve.gateway.observability import GatewayObserver
from splitserve.gateway.orchestrator import Orchestrator
from splitserve.gateway.relay import StreamReader
from splitserve.gateway.replicas import SharedRequests
from splitserve.gateway.requests import Claim, RequestTable
from splitserve.gateway.validation import Job, validate_request
from splitserve.protos.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from splitserve.runtime.auth import caller


@dataclass(frozen=True)
class ModelInfo:
    name: str
    config: ModelConfig
    max_model_len: int
    block_size: int


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer,
        model: ModelInfo,
        max_inflight: int,
        observer: GatewayObserver,
        max_inflight_per_key: int = 0,
        max_tokens_per_minute_per_key: int = 0,
        stream_interval: int = 1,
        stream_interval_ms: int = 0,
        shared: SharedRequests | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.observer = observer
        self.tokenizer = tokenizer
        self.model = model
        self._slots = threading.BoundedSemaphore(max_inflight)
        self.max_inflight = max_inflight
        self.requests = RequestTable()
        # The request ids of every gateway replica, in Redis (None: this one alone)
        self.shared = shared
        self.limits = AdvertisedLimits(orchestrator.registry)
        # Run-time LoRA loads and unloads on every live worker
        self.adapters = AdapterAdmin(orchestrator.registry, orchestrator.stubs, self.limits)
        self.per_key = PerKeyInflight(max_inflight_per_key)
        self.token_rate = PerKeyTokenRate(max_tokens_per_minute_per_key)
        # Tokens per client message when a request does not say (--stream-interval)
        self.stream_interval = check_stream_interval(stream_interval, "--stream-interval")
        # Milliseconds between a stream's messages at least (--stream-interval-ms; 0: off)
        self.stream_interval_ms = check_stream_interval_ms(
            stream_interval_ms, "--stream-interval-ms"
        )

    def _validate(self, request: gateway_pb2.GenerateRequest) -> Job:
        limits = self.limits.current()
        check_request(request, limits)
        job = validate_request(request, self.tokenizer, self.model.config, self.model.max_model_len)
        check_job(job, limits)
        if job.adapter is not None and job.adapter not in limits.adapters:
            check_adapter(job.adapter, self.limits.current(fresh=True))
        return job

    def _interval(self, request: gateway_pb2.GenerateRequest) -> tuple[int, int]:
        """(tokens, milliseconds) per client message at least: the request's, or the flags'."""
        tokens, ms = self.stream_interval, self.stream_interval_ms
        if request.HasField("stream_interval"):
            tokens = check_stream_interval(request.stream_interval)
        if request.HasField("stream_interval_ms"):
            ms = check_stream_interval_ms(request.stream_interval_ms)
        return tokens, ms

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        # NOTE: in a thread: tokenizing a long prompt would stall every other stream.
        job = await asyncio.to_thread(self._validate, request)
        interval = self._interval(request)
        # NOTE: before anything it could undo; the request belongs to the caller's API key
        claim = self.requests.claim(job.request_id, caller())
        job = _on_workers(job, claim.owner)
        shared = False
        try:
            if self.shared is not None:  # NOTE: refused if another replica runs the id
                # NOTE: not `claim.aborted |= await …`: that reads the flag before the await
                # and would undo an Abort that lands meanwhile.
                if await asyncio.to_thread(self.shared.claim, claim.request_id, claim.owner):
                    claim.aborted = True
                shared = True
            with self.per_key.hold(claim.owner), self._charged(job, claim):
                if not self._slots.acquire(blocking=False):
                    raise Overloaded(
                        f"the gateway is at its limit of {self.max_inflight} requests in flight",
                    )
                try:
                    async for msg in self._generate(job, claim, context, interval):
                        yield msg
                finally:
                    self._slots.release()
        finally:
            self.requests.release(claim)
            if shared:
                self._release_shared(claim)

    @contextlib.contextmanager
    def _charged(self, job: Job, claim: Claim) -> Iterator[None]:
        """The request's tokens against its key's rate (--max-tokens-per-minute-per-key):
        charged at most what it may use, given back what it did not generate."""
        most = job.params.n * job.params.max_tokens
        self.token_rate.charge(claim.owner, len(job.prompt_token_ids) + most)
        try:
            yield
        finally:
            self.token_rate.refund(claim.owner, most - claim.generated)

    async def _generate(
        self,
        job: Job,
        claim: Claim,
        context: grpc.aio.ServicerContext,
        interval: tuple[int, int],
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        obs = self.observer.start(job, context)
        # NOTE: a client that goes away cancels this task; closing the reader then aborts the
        # request on P and D before the stream ends. An Abort does the same through `claim`.
        responses = self.orchestrator.run(
            job, context.time_remaining(), lambda: not (context.done() or context.cancelled()), obs
        )
        rid, num_generated = claim.request_id, 0  # NOTE: the client's id, not the workers'
        tokens, ms = interval
        coalescer = Coalescer(tokens)
        # NOTE: once we fall behind (or from the second message on, with a time gate), a task
        # reads ahead and what queued up goes out merged; a stream that joins what queued up
        # (a DecodeMany stream, which joins one sample's chunks per read) needs no task
        joins = self.orchestrator.stubs.joins and job.params.n == 1
        reader = StreamReader(responses, claim, min_gap_s=ms / 1000, joins=joins)
        try:
            # NOTE: an Abort stops the stream before its next message, as between two reads
            while (batch := await reader.take()) and not claim.aborted:
                # NOTE: a stream's `finished` is its last message: it can only end a batch
                end = batch.pop() if batch[-1].HasField("finished") else None
                for chunk in merge_deltas([msg.chunk for msg in batch]):
                    num_generated += len(chunk.token_ids)
                    claim.generated = num_generated
                    delta = coalescer.add(chunk)
                    if delta is not None:
                        obs.on_chunk(len(delta.token_ids))
                        yield gateway_pb2.GenerateResponse(request_id=rid, chunk=delta)
                if end is not None:
                    for delta in coalescer.flush():
                        obs.on_chunk(len(delta.token_ids))
                        yield gateway_pb2.GenerateResponse(request_id=rid, chunk=delta)
                    claim.finished = True
                    done = gateway_pb2.Finished(
                        samples=end.finished.samples, usage=end.finished.usage
                    )
                    obs.on_finished(done)
                    yield gateway_pb2.GenerateResponse(request_id=rid, finished=done)
            if claim.aborted and not claim.finished:
                await reader.close()  # NOTE: first: what the request holds is freed
                for delta in coalescer.flush():  # NOTE: usage counts them: the client gets them
                    yield gateway_pb2.GenerateResponse(request_id=rid, chunk=delta)
                claim.finished = True
                done = _aborted(job, num_generated)
                obs.on_finished(done)
                yield gateway_pb2.GenerateResponse(request_id=rid, finished=done)
        except BaseException as exc:
            obs.end(exc)
            raise
        else:
            obs.end(None)
        finally:
            await reader.close()  # NOTE: now (frees the route), not whenever the GC does

    def _release_shared(self, claim: Claim) -> None:
        """Give the id back in Redis without holding up the stream's end."""
        assert self.shared is not None
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, self.shared.release, claim.request_id, claim.owner)

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        rid, owner = request.request_id, caller()
        here = self.requests.holds(rid, owner)
        aborted = self.requests.abort(rid, owner)
        if not here and self.shared is not None:  # NOTE: it may run on another replica
            aborted = await asyncio.to_thread(self.shared.abort_elsewhere, rid, owner)
        return common_pb2.AbortResponse(aborted=aborted)

    async def LoadLoRAAdapter(
        self, request: gateway_pb2.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.LoRAAdapterReply:
        ids = await self.adapters.load(request.lora_name, request.lora_path)
        return gateway_pb2.LoRAAdapterReply(worker_ids=ids)

    async def UnloadLoRAAdapter(
        self, request: gateway_pb2.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.LoRAAdapterReply:
        ids = await self.adapters.unload(request.lora_name)
        return gateway_pb2.LoRAAdapterReply(worker_ids=ids)

    async def GetModelInfo(
        self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetModelInfoResponse:
        cfg = self.model.config
        return gateway_pb2.GetModelInfoResponse(
            model_name=self.model.name,
            architecture=cfg.architecture,
            max_model_len=self.model.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=cfg.eos_token_ids,
            block_size=self.model.block_size,
        )


def _on_workers(job: Job, owner: str) -> Job:
    """The job as the workers know it: ids are scoped per API key here, so another key's
    request with the same id must not meet this one on a worker either."""
    if not owner:
        return job
    return replace(job, request_id=f"{job.request_id}@{owner}")


def _aborted(job: Job, num_generated: int) -> gateway_pb2.Finished:
    """The final message of an aborted request: every sample ends with FINISH_REASON_ABORT."""
    return gateway_pb2.Finished(
        samples=[
            common_pb2.SampleFinish(index=i, finish_reason=common_pb2.FINISH_REASON_ABORT)
            for i in range(job.params.n)
        ],
        usage=common_pb2.Usage(
            prompt_tokens=len(job.prompt_token_ids), completion_tokens=num_generated
        ),
    )
