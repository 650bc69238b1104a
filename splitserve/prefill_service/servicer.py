"""gRPC face of the prefill worker.

Its methods are coroutines on the server's event loop. A prefill's send loop blocks (it waits
for the engine's finished blocks and pushes them), so it runs on a thread of this servicer's
own pool; the gateway bounds how many prefills one worker gets. A cancelled call (the gateway
gave up, or its deadline passed) tells the send loop to stop and waits until it has settled, so
the worker's blocks are free once the call is over.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from splitserve.engine.aio import settled
from splitserve.engine.errors import FailedPrecondition, quoted
from splitserve.engine.lora.request import check_adapter_name
from splitserve.prefill_service.worker import PrefillResult, PrefillWorker
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.runtime.tracing import Tracing

MAX_PREFILL_THREADS = 256


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self, worker: PrefillWorker, tracing: Tracing, max_threads: int = MAX_PREFILL_THREADS
    ) -> None:
        self.worker = worker
        self.tracing = tracing
        self._threads = ThreadPoolExecutor(max_threads, thread_name_prefix="prefill")

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        if request.adapter != request.destination.adapter:
            mine, theirs = request.adapter or "(base)", request.destination.adapter or "(base)"
            raise FailedPrecondition(
                f"the request runs under LoRA adapter {quoted(mine)} but its decode worker "
                f"reserved under {quoted(theirs)}: KV computed under one adapter is never sent "
                "for another"
            )
        cancelled = threading.Event()
        prefill = functools.partial(
            self.worker.prefill,
            request.request_id,
            list(request.prompt_token_ids),
            convert.sampling_from_proto(request.sampling),
            request.destination,
            request.priority,
            lambda: not cancelled.is_set(),
            self.tracing.extract(context),
        )
        running = asyncio.get_running_loop().run_in_executor(self._threads, prefill)
        try:
            result: PrefillResult = await asyncio.shield(running)
        except asyncio.CancelledError:
            cancelled.set()
            await settled(running)
            raise
        return worker_pb2.PrefillResponse(
            first_tokens=convert.first_tokens_to_proto(result.output),
            num_blocks_sent=result.num_blocks_sent,
            num_bytes_sent=result.num_bytes_sent,
            num_cached_tokens=result.output.num_cached_tokens,
        )

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted=await self.worker.abort(request.request_id))

    async def LoadAdapter(
        self, request: worker_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AdapterList:
        names = await self.worker.load_adapter(check_adapter_name(request.name), request.path)
        return worker_pb2.AdapterList(adapters=names)

    async def UnloadAdapter(
        self, request: worker_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AdapterList:
        return worker_pb2.AdapterList(adapters=await self.worker.unload_adapter(request.name))

    async def GetStats(
        self, request: worker_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        worker = self.worker
        return convert.stats_to_proto(
            await worker.stats(),
            worker.settings.worker_id,
            kv_bytes_sent=worker.num_bytes_sent,
        )

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
