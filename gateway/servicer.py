"""The public Gateway service: thin over validation and the orchestrator. Its methods are
coroutines and async generators on the server's event loop: a stream waiting for tokens holds
no thread, so `max_inflight` alone bounds how many run at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from splitserve.engine.errors import Overloaded
from splitserve.engine.model_config import ModelConfig
from splitserve.gateway.observability import GatewayObserver
from splitserve.gateway.orchestrator import Orchestrator
from splitserve.gateway.validation import validate_request
from splitserve.protos.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


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
    ) -> None:
        self.orchestrator = orchestrator
        self.observer = observer
        self.tokenizer = tokenizer
        self.model = model
        self._slots = threading.BoundedSemaphore(max_inflight)
        self.max_inflight = max_inflight

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        # NOTE: in a thread: tokenizing a long prompt would stall every other stream.
        job = await asyncio.to_thread(
            validate_request, request, self.tokenizer, self.model.config, self.model.max_model_len
        )
        if not self._slots.acquire(blocking=False):
            raise Overloaded(
                f"the gateway is at its limit of {self.max_inflight} requests in flight",
            )
        obs = self.observer.start(job, context)
        # NOTE: a client that goes away cancels this task; the orchestrator then aborts the
        # request on P and D before the stream ends.
        responses = self.orchestrator.run(
            job, context.time_remaining(), lambda: not (context.done() or context.cancelled()), obs
        )
        try:
            rid = job.request_id
            async for msg in responses:
                if msg.HasField("chunk"):
                    obs.on_chunk()
                    yield gateway_pb2.GenerateResponse(request_id=rid, chunk=msg.chunk)
                else:
                    done = gateway_pb2.Finished(
                        samples=msg.finished.samples, usage=msg.finished.usage
                    )
                    obs.on_finished(done)
                    yield gateway_pb2.GenerateResponse(request_id=rid, finished=done)
        except BaseException as exc:
            obs.end(exc)
            raise
        else:
            obs.end(None)
        finally:
            await responses.aclose()  # NOTE: now (frees the route), not whenever the GC does
            self._slots.release()

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted=await self.orchestrator.abort(request.request_id))

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
