"""Starting the gateway in this process: its gRPC server (health NOT_SERVING, every method
UNAVAILABLE "loading" until bound; one of a group of processes listens only once loaded), /metrics,
the tokenizer and routing, then the Gateway servicer and the OpenAI-compatible HTTP API beside it.
`splitserve gateway --processes N` runs N of these, one per process (`gateway_processes.py`)."""

from __future__ import annotations

import ssl
import uuid
from collections.abc import Callable, Iterable

import redis
from transformers import PreTrainedTokenizerBase

from splitserve.engine.model_config import ModelConfig
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.gateway.failover import FailoverSettings
from splitserve.gateway.http_server import Authorize, HttpFrontDoor, create_app
from splitserve.gateway.observability import GatewayObserver
from splitserve.gateway.orchestrator import Orchestrator, OrchestratorSettings
from splitserve.gateway.prefill_ledger import RedisLedger
from splitserve.gateway.prefix_follower import PrefixFollower, live_ids
from splitserve.gateway.replicas import SharedRequests
from splitserve.gateway.router import make_policy
from splitserve.gateway.servicer import GatewayServicer, ModelInfo
from splitserve.gateway.stubs import Stubs
from splitserve.kv_transfer.prefix_events import PrefixEventLog
from splitserve.kv_transfer.registry import Registry
from splitserve.protos.v1 import gateway_pb2_grpc
from splitserve.runtime.auth import member_channel_interceptors
from splitserve.runtime.gc_heap import settle
from splitserve.runtime.lifecycle import State
from splitserve.runtime.metrics import RequestMetrics, RoutingMetrics
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Opened, Running, ServiceSpec, open_service
from splitserve.runtime.settings import GatewaySettings, ServiceSettings
from splitserve.runtime.tracing import Tracing

GATEWAY_SERVICE = "splitserve.v1.Gateway"


def _load(model: str) -> tuple[ModelConfig, PreTrainedTokenizerBase]:
    return ModelConfig.from_pretrained(model), load_tokenizer(model)


def start_gateway(
    service: ServiceSettings,
    gateway: GatewaySettings,
    tracing: Tracing | None = None,
    security: Security | None = None,
    reuse_port: bool = False,
) -> Running:
    """A gateway in this process; `reuse_port`: one of `--processes N`, sharing its ports."""
    tracing = tracing or Tracing.disabled()
    security = security or Security()
    loaded = None
    if reuse_port:
        # NOTE: one of a group listens only once loaded: the kernel spreads new connections
        # over every listening process, and one still loading would refuse its share of them
        # (and a restarted one would, while the others serve).
        loaded = _load(service.model)
    opened = open_service(
        service,
        [
            ServiceSpec(
                GATEWAY_SERVICE, gateway_pb2_grpc.add_GatewayServicer_to_server, ("Generate",)
            )
        ],
        interceptors=security.gateway_interceptors(),
        credentials=security.server_credentials(),
        reuse_port=reuse_port,
        metrics_secret=security.metrics_secret(service.metrics_bind_host, service.metrics_port),
    )
    metrics = opened.metrics
    follower: PrefixFollower | None = None
    try:
        model_config, tokenizer = loaded or _load(service.model)
        registry = Registry(
            service.redis_url, retry_s=service.registry_retry_s, secret=security.cluster_secret
        )
        # NOTE: an id of its own per start: a restarted process never meets its old leases.
        replica_id = f"{service.worker_id}-{uuid.uuid4().hex[:6]}"
        shared_redis = redis.Redis.from_url(
            service.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0
        )
        follower = PrefixFollower(
            PrefixEventLog(
                redis.Redis.from_url(
                    service.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0
                ),
                registry.namespace,
            ),
            live_ids(registry),
        ).start()
        orchestrator = Orchestrator(
            registry,
            make_policy(gateway.routing_policy),
            OrchestratorSettings(
                block_size=gateway.block_size,
                host_block_weight=gateway.host_block_weight,
                local_prefill_tokens=gateway.local_prefill_tokens,
                default_timeout_s=gateway.request_timeout_s,
                max_prefill_tokens_per_worker=gateway.max_prefill_tokens_per_worker,
                failover=FailoverSettings(
                    rpc_timeout_s=gateway.rpc_timeout_s,
                    reserve_timeout_s=gateway.reserve_timeout_s,
                    reserve_hedge_s=gateway.reserve_hedge_s,
                    stall_timeout_s=gateway.stall_timeout_s,
                    suspect_s=gateway.suspect_s,
                    max_migrations=gateway.max_migrations,
                ),
            ),
            stubs=Stubs(
                member_channel_interceptors(security.cluster_secret, forward_caller=True),
                decode_many=gateway.decode_many,
            ),
            ledger=RedisLedger(shared_redis, replica_id, registry.namespace),
            prefix_index=follower,
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
        routing = RoutingMetrics(metrics)
        orchestrator.suspects.on_suspect = routing.suspected
        observer = GatewayObserver(tracing, requests, routing, info.name)
        shared = SharedRequests(shared_redis, replica_id, registry.namespace)
        servicer = GatewayServicer(
            orchestrator,
            tokenizer,
            info,
            gateway.max_inflight,
            observer,
            max_inflight_per_key=gateway.max_inflight_per_key,
            max_tokens_per_minute_per_key=gateway.max_tokens_per_minute_per_key,
            stream_interval=gateway.stream_interval,
            stream_interval_ms=gateway.stream_interval_ms,
            shared=shared,
        )
        opened.gates[0].bind(servicer)
        shared.start(opened.server.loop, servicer.requests.abort, servicer.requests.ids)
        # NOTE: its channels to the workers live on the server's loop: closed there, at stop.
        opened.server.on_stop(orchestrator.close)
        http = start_http(
            opened, tokenizer, info, service.host, gateway.http_port, security.http_authorize(),
            gateway.tool_call_parser, reuse_port=reuse_port,
            adapters=lambda: servicer.limits.current().adapters,
            lora_admin=servicer.adapters, ssl_context=security.http_ssl_context(),
        )  # fmt: skip
    except BaseException:
        if follower is not None:
            follower.stop()
        opened.close()
        raise
    pauses = settle("gateway")
    opened.lifecycle.set_serving()

    def stop() -> None:
        opened.lifecycle.start_draining()
        if http is not None:
            http.stop(opened.server)
        opened.server.stop()
        shared.stop()
        follower.stop()
        registry.close()
        metrics.close()
        pauses.log_summary()

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
    tool_call_parser: str = "auto",
    reuse_port: bool = False,
    adapters: Callable[[], Iterable[str]] | None = None,
    lora_admin: object = None,
    ssl_context: ssl.SSLContext | None = None,
) -> HttpFrontDoor | None:
    """The OpenAI-compatible HTTP API beside the gRPC one (None when `port` is 0): it calls
    the same Gateway servicer, through the same lifecycle gate, on the same event loop, and
    checks the same API keys (`authorize`); its /metrics serves the gateway's registry.
    With `ssl_context` (the gateway's TLS certificate) it serves HTTPS only."""
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
        tool_call_parser,
        opened.metrics.registry,
        adapters,
        lora_admin,
    )
    http = HttpFrontDoor(app, host, port, reuse_port=reuse_port, ssl_context=ssl_context)
    http.start(opened.server)
    return http
