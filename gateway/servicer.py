"""The public Gateway service: thin over validation and the orchestrator."""

from __future__ import annotations

import threading
from collections.abc import Iterator
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

    def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        job = validate_request(request, self.tokenizer, self.model.config, self.model.max_model_len)
        if not self._slots.acquire(blocking=False):
            raise Overloaded(
                f"the gateway is at its limit of {self.max_inflight} requests in flight",
            )
        obs = self.observer.start(job, context)
        responses = self.orchestrator.run(job, context.time_remaining(), context.is_active, obs)
        try:
            # NOTE: runs when the RPC ends for any reason; after a normal finish it finds no
            # route and does nothing, after a client cancel it reaches P and D.
            context.add_callback(lambda: self.orchestrator.abort(job.request_id))
            rid = job.request_id
            for msg in responses:
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
            responses.close()  # NOTE: now (frees the route), not whenever the GC gets to it
            self._slots.release()

    def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted=self.orchestrator.abort(request.request_id))

    def GetModelInfo(
        self, request: gateway_pb2.GetModelInfoRequest, context: grpc.ServicerContext
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
