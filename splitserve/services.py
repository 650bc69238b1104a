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
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.gateway.http_server import Authorize, HttpFrontDoor, create_app
from splitserve.gateway.migration import FailoverSettings
from splitserve.gateway.observability import GatewayObserver
from splitserve.gateway.orchestrator import Orchestrator, OrchestratorSettings
from splitserve.gateway.router import make_policy
from splitserve.gateway.servicer import GatewayServicer, ModelInfo
from splitserve.gateway.stubs import Stubs
from splitserve.kv_transfer.presence import Presence
from splitserve.kv_transfer.registry import Registry
from splitserve.kv_transfer.transport import ReceiverBind
from splitserve.kv_transports import start_receivers, start_senders
from splitserve.prefill_service.observed_transport import ObservedSender
from splitserve.prefill_service.observer import PrefillObserver
from splitserve.prefill_service.pusher import Senders
from splitserve.prefill_service.servicer import PrefillServicer
from splitserve.prefill_service.worker import PrefillSettings, PrefillWorker
from splitserve.protos.v1 import gateway_pb2_grpc, worker_pb2_grpc
from splitserve.runtime.auth import member_channel_interceptors
from splitserve.runtime.engine_metrics import EngineCollector
from splitserve.runtime.lifecycle import State
from splitserve.runtime.metrics import KVTransferMetrics, RequestMetrics, RoutingMetrics
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Opened, Running, ServiceSpec, open_service
from splitserve.runtime.settings import GatewaySettings, ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing
from splitserve.workers import build_engine, worker_info

GATEWAY_SERVICE = "splitserve.v1.Gateway"
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


def start_gateway(
    service: ServiceSettings,
    gateway: GatewaySettings,
    tracing: Tracing | None = None,
    security: Security | None = None,
) -> Running:
    tracing = tracing or Tracing.disabled()
    security = security or Security()
    opened = open_service(
        service,
        [
            ServiceSpec(
                GATEWAY_SERVICE, gateway_pb2_grpc.add_GatewayServicer_to_server, ("Generate",)
            )
        ],
        interceptors=security.gateway_interceptors(),
        credentials=security.server_credentials(),
    )
    metrics = opened.metrics
    try:
        model_config = ModelConfig.from_pretrained(service.model)
        tokenizer = load_tokenizer(service.model)
        registry = Registry(
            service.redis_url, retry_s=service.registry_retry_s, secret=security.cluster_secret
        )
        orchestrator = Orchestrator(
            registry,
            make_policy(gateway.routing_policy),
            OrchestratorSettings(
                block_size=gateway.block_size,
                local_prefill_tokens=gateway.local_prefill_tokens,
                default_timeout_s=gateway.request_timeout_s,
                max_prefill_tokens_per_worker=gateway.max_prefill_tokens_per_worker,
                failover=FailoverSettings(
                    rpc_timeout_s=gateway.rpc_timeout_s,
                    stall_timeout_s=gateway.stall_timeout_s,
                    suspect_s=gateway.suspect_s,
                    max_migrations=gateway.max_migrations,
                ),
            ),
            stubs=Stubs(member_channel_interceptors(security.cluster_secret, forward_caller=True)),
        )
        info = ModelInfo(
            name=service.served_model_name,
            config=model_config,
            max_model_len=model_config.max_model_len,
            block_size=gateway.block_size,
        )
        requests = RequestMetrics(
            metrics,
            ("time_to_first_token", "inter_token_latency", "e2e_request_latency"),
            outcomes=True,
        )
        observer = GatewayObserver(tracing, requests, RoutingMetrics(metrics), info.name)
        opened.gates[0].bind(
            GatewayServicer(
                orchestrator,
                tokenizer,
                info,
                gateway.max_inflight,
                observer,
                max_inflight_per_key=gateway.max_inflight_per_key,
                max_tokens_per_minute_per_key=gateway.max_tokens_per_minute_per_key,
            )
        )
        # NOTE: its channels to the workers live on the server's loop: closed there, at stop.
        opened.server.on_stop(orchestrator.close)
        http = start_http(
            opened, tokenizer, info, service.host, gateway.http_port, security.http_authorize()
        )
    except BaseException:
        opened.close()
        raise
    opened.lifecycle.set_serving()

    def stop() -> None:
        opened.lifecycle.start_draining()
        if http is not None:
            http.stop(opened.server)
        opened.server.stop()
        registry.close()
        metrics.close()

    return Running(
        opened.server,
        opened.address,
        opened.lifecycle,
        metrics,
        stop,
        worker=orchestrator,
        http_port=http.port if http is not None else 0,
    )


def start_http(
    opened: Opened,
    tokenizer: object,
    info: ModelInfo,
    host: str,
    port: int,
    authorize: Authorize | None = None,
) -> HttpFrontDoor | None:
    """The OpenAI-compatible HTTP API beside the gRPC one (None when `port` is 0): it calls
    the same Gateway servicer, through the same lifecycle gate, on the same event loop, and
    checks the same API keys (`authorize`)."""
    if not port:
        return None
    gate = opened.gates[0]
    lifecycle = opened.lifecycle
    app = create_app(
        lambda request, call: gate.Generate(request, call),
        info,
        tokenizer,
        lambda: lifecycle.state is State.SERVING,
        authorize,
    )
    http = HttpFrontDoor(app, host, port)
    http.start(opened.server)
    return http
