"""gRPC face of the decode worker: protobuf in, `DecodeWorker` call, protobuf out. Its methods
are coroutines and async generators on the server's event loop: a stream waiting for tokens
holds no thread."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from splitserve.decode_service.decode_many import DecodeMany
from splitserve.decode_service.handoff import StreamMoved
from splitserve.decode_service.observer import DecodeObserver
from splitserve.decode_service.worker import DecodeWorker
from splitserve.engine.errors import InvalidRequest
from splitserve.engine.lora.request import check_adapter_name
from splitserve.engine.outputs import RequestOutput
from splitserve.kv_transfer.cluster import caller_of
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, observer: DecodeObserver) -> None:
        self.worker = worker
        self.observer = observer

    async def Reserve(
        self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        params = convert.sampling_from_proto(request.sampling)
        with self.observer.reserve(request.request_id, context) as span:
            resume = None
            if request.HasField("resume"):
                resume = convert.resume_from_proto(request.resume)
            res = await self.worker.reserve(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                resume,
                caller=caller_of(context.invocation_metadata()),
                adapter=request.adapter or None,
            )
            settings = self.worker.settings
            destination = worker_pb2.KVDestination(
                worker_id=settings.worker_id,
                address=settings.address,
                block_ids=res.block_ids,
                num_cached_tokens=res.num_cached_tokens,
                fence=res.fence,
                kv_transports=settings.kv_transports,
                capability=res.capability,
                adapter=request.adapter,
                window_slots=res.window_slots,
            )
            self.observer.reserved(span, destination)
        if context.cancelled():
            # NOTE: the caller left (a hedge's loser) before the grant: nobody will use it
            await self.worker.abort(request.request_id)
        return worker_pb2.ReserveResponse(destination=destination)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        params = convert.sampling_from_proto(request.sampling)
        tracker = convert.DeltaTracker.for_params(params)
        handed_off = None
        if request.HasField("resume"):
            tracker.resume_after(request.resume)
            if request.kv_handed_off:
                handed_off = len(request.resume.output_token_ids)
        elif request.kv_handed_off:
            raise InvalidRequest("kv_handed_off needs the resumed tokens (resume)")
        obs = self.observer.decode(request.request_id, params, context)
        # NOTE: a DecodeMany stream's plain chunks skip its task (decode_service/pace.py)
        sink: Callable[[common_pb2.SampleDelta], None] | None = getattr(
            context, "direct_sink", None
        )

        def direct(out: RequestOutput) -> None:
            deltas = tracker.deltas(out)
            obs.on_output(max((len(d.token_ids) for d in deltas), default=0))
            for delta in deltas:
                sink(delta)  # type: ignore[misc]

        outputs = self.worker.decode(
            request.request_id,
            params,
            convert.first_tokens_from_proto(request.first_tokens),
            request.priority,
            on_admitted=obs.admitted,
            num_resumed_handed_off=handed_off,
            direct=direct if sink is not None else None,
        )
        try:
            async for out in outputs:
                deltas = tracker.deltas(out)
                obs.on_output(max((len(d.token_ids) for d in deltas), default=0))
                for delta in deltas:
                    yield worker_pb2.DecodeResponse(chunk=delta)
                if out.finished:
                    finished = worker_pb2.DecodeFinished(
                        samples=convert.finishes_to_proto(out), usage=convert.usage_to_proto(out)
                    )
                    obs.on_finished(finished, out.speculation)
                    yield worker_pb2.DecodeResponse(finished=finished)
        except StreamMoved as exc:
            obs.end(exc)
            # NOTE: the trailer tells the gateway the stream's KV waits here for a hand-off
            kept = exc.num_kv_tokens
            trailer = () if kept is None else ((convert.KV_HANDOFF_TRAILER, str(kept)),)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailer)
        except BaseException as exc:
            obs.end(exc)
            raise
        finally:
            await outputs.aclose()  # NOTE: now (frees the request), not whenever the GC gets to it
        obs.end(None)

    async def DecodeMany(
        self,
        controls: AsyncIterator[worker_pb2.DecodeControl],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.DecodeBatch]:
        # NOTE: at once: the gateway writes nothing before it knows the call was accepted
        await context.send_initial_metadata(())
        async for batch in DecodeMany(self.Decode).serve(controls):
            yield batch

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted=await self.worker.abort(request.request_id))

    async def HandOff(
        self, request: worker_pb2.HandOffRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.HandOffResponse:
        if not request.destination_request_id or not request.num_tokens:
            raise InvalidRequest("a hand-off names its destination's request and a token count")
        num_blocks, num_bytes = await self.worker.handoffs.hand_off(
            request.request_id,
            request.destination,
            request.destination_request_id,
            request.num_tokens,
        )
        return worker_pb2.HandOffResponse(num_blocks_sent=num_blocks, num_bytes_sent=num_bytes)

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
            num_reservations=len(worker.reservations),
            kv_bytes_received=worker.num_bytes_received,
            kv_blocks_received=worker.num_blocks_received,
            num_reclaimed=worker.num_reclaimed,
            num_handoffs_sent=worker.handoffs.num_sent,
            num_leases_rewritten=worker.num_leases_rewritten,
        )
