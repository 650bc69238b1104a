"""gRPC face of the prefill worker."""

from __future__ import annotations

import grpc

from splitserve.prefill_service.worker import PrefillWorker
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.runtime.tracing import Tracing


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, tracing: Tracing) -> None:
        self.worker = worker
        self.tracing = tracing

    def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        result = self.worker.prefill(
            request.request_id,
            list(request.prompt_token_ids),
            convert.sampling_from_proto(request.sampling),
            request.destination,
            request.priority,
            context.is_active,
            self.tracing.extract(context),
        )
        return worker_pb2.PrefillResponse(
            first_tokens=convert.first_tokens_to_proto(result.output),
            num_blocks_sent=result.num_blocks_sent,
            num_bytes_sent=result.num_bytes_sent,
            num_cached_tokens=result.output.num_cached_tokens,
        )

    def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted=self.worker.abort(request.request_id))

    def GetStats(
        self, request: worker_pb2.GetStatsRequest, context: grpc.ServicerContext
    ) -> worker_pb2.WorkerStats:
        worker = self.worker
        return convert.stats_to_proto(
            worker.loop.call(lambda e: e.stats()),
            worker.settings.worker_id,
            kv_bytes_sent=worker.num_bytes_sent,
        )
