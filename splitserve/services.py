"""Starting each kind of service in this process: decode (or colocated), prefill, gateway.

Each starts its gRPC server first (health NOT_SERVING; every method answers UNAVAILABLE
"loading") and its /metrics endpoint, then loads what it serves, binds the real servicers, joins
the registry and turns SERVING. `Running.drain` then `Running.stop` is the graceful way out.
"""

from __future__ import annotations

from splitserve.decode_service.observer import DecodeObserver
from splitserve.decode_service.reservations import ReservationBook
from splitserve.decode_service.servicer import DecodeServicer
from splitserve.decode_service.worker import DecodeSettings, DecodeWorker
from splitserve.engine.engine_loop import EngineLoop

# NOTE: the gateway starts in a module of its own (gateway_service.py); found here too.
from splitserve.gateway_service import GATEWAY_SERVICE as GATEWAY_SERVICE
from splitserve.gateway_service import start_gateway as start_gateway
from splitserve.gateway_service import start_http as start_http
from splitserve.kv_transfer.presence import Presence
from splitserve.kv_transfer.registry import Registry
from splitserve.kv_transfer.transport import ReceiverBind
from splitserve.kv_transports import start_receivers, start_senders
from splitserve.prefill_service.observed_transport import ObservedSender
from splitserve.prefill_service.observer import PrefillObserver
from splitserve.prefill_service.pusher import Senders
from splitserve.prefill_service.servicer import PrefillServicer
from splitserve.prefill_service.worker import PrefillSettings, PrefillWorker
from splitserve.protos.v1 import worker_pb2_grpc
from splitserve.runtime.engine_metrics import EngineCollector
from splitserve.runtime.metrics import KVTransferMetrics, RequestMetrics
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Running, ServiceSpec, open_service
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing
from splitserve.workers import build_engine, worker_info

PREFILL_SERVICE = "splitserve.v1.PrefillWorker"
DECODE_SERVICE = "splitserve.v1.DecodeWorker"


def start_decode(
    service: ServiceSettings,
    worker: WorkerSettings,
    kind: str = "decode",
    tracing: Tracing | None = None,
    security: Security | None = None,
) -> Running:
    """A decode worker (kind "decode"), or a colocated one that also prefills ("colocated")."""
    tracing = tracing or Tracing.disabled()
    security = security or Security()
    opened = open_service(
        service,
        [
            ServiceSpec(
                DECODE_SERVICE, worker_pb2_grpc.add_DecodeWorkerServicer_to_server, ("Reserve",)
            ),
        ],
        interceptors=security.worker_interceptors(),
    )
    address, metrics = opened.address, opened.metrics
    try:
        engine = build_engine(service, worker, record_prefix_events=True)
        loop = EngineLoop(engine).start()
        registry = Registry(
            service.redis_url, retry_s=service.registry_retry_s, secret=security.cluster_secret
        )
        reservations = ReservationBook(per_caller=worker.max_reservations_per_caller)
        tracer = tracing.tracer if tracing.enabled else None
        received = KVTransferMetrics(metrics)
        receivers, offered = (
            ([], ())
            if kind == "colocated"
            else start_receivers(
                worker.kv_transport,
                engine.kv_connector,
                reservations,
                service.worker_id,
                tracer,
                received.observe,
                ReceiverBind(
                    service.host,
                    worker.kv_port,
                    service.public_host,
                    security.cluster_secret,
                    vouch=registry.kv_endpoint_values,  # the senders members published
                ),
            )
        )
        decode = DecodeWorker(
            loop,
            registry,
            DecodeSettings(
                service.worker_id, address, lease_s=worker.lease_s, kv_transports=offered
            ),
            reservations,
        )
        metrics.registry.register(EngineCollector(loop, metrics.model_name))
        requests = RequestMetrics(
            metrics, ("inter_token_latency", "e2e_request_latency"), outcomes=True
        )
        observer = DecodeObserver(tracing, requests, metrics.model_name)
        opened.gates[0].bind(DecodeServicer(decode, observer))
        endpoint = {k: v for r in receivers for k, v in r.endpoint().items()}
        presence = Presence(
            registry,
            lambda: worker_info(
                kind, service.worker_id, address, loop.call(lambda e: e.stats()), offered, engine
            ),
            ttl_s=worker.heartbeat_ttl_s,
            interval_s=worker.heartbeat_ttl_s / 6,
            on_tick=decode.housekeeping,
            kv_endpoint=endpoint,
            on_rejoin=decode.republish_prefix_index,
        ).start()
    except BaseException:
        opened.close()
        raise
    # NOTE: a reservation waits for its Decode call; draining must not end in between.
    opened.lifecycle.also_wait_for(lambda: len(decode.reservations))
    opened.lifecycle.set_serving()

    def stop() -> None:
        opened.lifecycle.start_draining()
        presence.stop()
        decode.leave_prefix_index()
        opened.server.stop()
        for receiver in receivers:
            receiver.close()
        loop.stop()
        registry.close()
        metrics.close()

    return Running(opened.server, address, opened.lifecycle, metrics, stop, presence.leave, decode)


def start_prefill(
    service: ServiceSettings,
    worker: WorkerSettings,
    tracing: Tracing | None = None,
    security: Security | None = None,
) -> Running:
    tracing = tracing or Tracing.disabled()
    security = security or Security()
    opened = open_service(
        service,
        [
            ServiceSpec(
                PREFILL_SERVICE, worker_pb2_grpc.add_PrefillWorkerServicer_to_server, ("Prefill",)
            )
        ],
        interceptors=security.worker_interceptors(),
    )
    address, metrics = opened.address, opened.metrics
    try:
        engine = build_engine(service, worker)
        loop = EngineLoop(engine).start()
        registry = Registry(
            service.redis_url, retry_s=service.registry_retry_s, secret=security.cluster_secret
        )
        transfer_metrics = KVTransferMetrics(metrics)
        senders = Senders(
            {
                name: ObservedSender(sender, tracing, transfer_metrics)
                for name, sender in start_senders(
                    worker.kv_transport,
                    engine.kv_connector,
                    service.worker_id,
                    security.cluster_secret,
                ).items()
            },
            registry,
        )
        requests = RequestMetrics(
            metrics, ("request_queue_time", "request_prefill_time"), outcomes=False
        )
        observer = PrefillObserver(tracing, requests, metrics.model_name)
        prefill = PrefillWorker(
            loop,
            registry,
            senders,
            PrefillSettings(service.worker_id, lease_s=worker.lease_s),
            observer,
        )
        metrics.registry.register(EngineCollector(loop, metrics.model_name))
        servicer = PrefillServicer(prefill, tracing)
        opened.gates[0].bind(servicer)
        # NOTE: Prefill is refused until `set_serving`, after `start` wrote this record: a
        # decode worker that reads the registry on a sender's first push finds its name.
        presence = Presence(
            registry,
            lambda: worker_info(
                "prefill",
                service.worker_id,
                address,
                loop.call(lambda e: e.stats()),
                senders.names,
                engine,
            ),
            ttl_s=worker.heartbeat_ttl_s,
            interval_s=worker.heartbeat_ttl_s / 6,
            kv_endpoint=senders.endpoint(),
        ).start()
    except BaseException:
        opened.close()
        raise
    opened.lifecycle.set_serving()

    def stop() -> None:
        opened.lifecycle.start_draining()
        presence.stop()
        opened.server.stop()
        servicer.close()
        prefill.close()
        loop.stop()
        registry.close()
        metrics.close()

    return Running(opened.server, address, opened.lifecycle, metrics, stop, presence.leave, prefill)
