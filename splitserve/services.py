"""Starting each kind of service in this process: decode (or colocated), prefill, gateway.

Each starts its gRPC server first (health NOT_SERVING; every method answers UNAVAILABLE
"loading") and its /metrics endpoint, then loads what it serves, binds the real servicers, joins
the registry and turns SERVING. `Running.drain` then `Running.stop` is the graceful way out.
A worker's engine runs in its engine core (`splitserve/engine_core.py`), a process of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from splitserve.decode_service.observer import DecodeObserver
from splitserve.decode_service.reservations import ReservationBook
from splitserve.decode_service.servicer import DecodeServicer
from splitserve.decode_service.worker import DecodeSettings, DecodeWorker
from splitserve.engine.stats import EngineStats
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.engine_core import CoreSpec, run_core
from splitserve.gateway_service import GATEWAY_SERVICE as GATEWAY_SERVICE
from splitserve.gateway_service import start_gateway as start_gateway
from splitserve.gateway_service import start_http as start_http
from splitserve.kv_transfer.presence import Presence
from splitserve.kv_transfer.registry import Registry
from splitserve.prefill_service.observer import PrefillObserver
from splitserve.prefill_service.pusher import Senders
from splitserve.prefill_service.servicer import PrefillServicer
from splitserve.prefill_service.worker import PrefillSettings, PrefillWorker
from splitserve.protos.v1 import worker_pb2_grpc
from splitserve.runtime.engine_core.client import CoreStartError, EngineCoreClient
from splitserve.runtime.engine_core.protocol import endpoint_from_wire
from splitserve.runtime.engine_metrics import EngineCollector
from splitserve.runtime.engine_watch import EngineWatch
from splitserve.runtime.metrics import KVTransferMetrics, RequestMetrics
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Opened, Running, ServiceSpec, open_service
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing
from splitserve.workers import worker_info

PREFILL_SERVICE = "splitserve.v1.PrefillWorker"
DECODE_SERVICE = "splitserve.v1.DecodeWorker"


def _start_core(
    role: str,
    service: ServiceSettings,
    worker: WorkerSettings,
    tracing: Tracing,
    security: Security,
    tokenizer: object | None,
) -> EngineCoreClient:
    """The worker's engine core (`--engine-core process`: a process of its own), loaded."""
    spec = CoreSpec(role, service, worker, security.cluster_secret, tracing.origin)
    core = EngineCoreClient(
        run_core,
        spec,
        tokenizer,  # type: ignore[arg-type]
        own_process=worker.engine_core == "process",
        name=f"{service.worker_id}-core",
    )
    try:
        return core.start()
    except CoreStartError as exc:
        if exc.kind == "ValueError":  # NOTE: bad settings stay a clear error (exit code 2)
            raise ValueError(str(exc)) from None
        raise


def _when_core_dies(
    core: EngineCoreClient,
    opened: Opened,
    presence: Presence,
    on_core_death: Callable[[BaseException], None] | None,
) -> None:
    """A worker whose engine core died is dead: it leaves the registry at once and stops
    serving (its streams fail UNAVAILABLE and move), or `on_core_death` decides (the CLI
    exits the process)."""

    def died(exc: BaseException) -> None:
        if on_core_death is not None:
            on_core_death(exc)
            return
        presence.leave()
        opened.server.stop(0)

    core.on_death = died


def _stats_of(core: EngineCoreClient) -> Callable[..., EngineStats]:
    def stats(timeout_s: float = 30.0) -> EngineStats:
        return EngineStats(**core.call("stats", timeout_s=timeout_s))

    return stats


def start_decode(
    service: ServiceSettings,
    worker: WorkerSettings,
    kind: str = "decode",
    tracing: Tracing | None = None,
    security: Security | None = None,
    on_core_death: Callable[[BaseException], None] | None = None,
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
        metrics_secret=security.metrics_secret(service.metrics_bind_host, service.metrics_port),
    )
    address, metrics = opened.address, opened.metrics
    core: EngineCoreClient | None = None
    try:
        core = _start_core(kind, service, worker, tracing, security, load_tokenizer(service.model))
        limits = core.info
        registry = Registry(
            service.redis_url, retry_s=service.registry_retry_s, secret=security.cluster_secret
        )
        reservations = ReservationBook(per_caller=worker.max_reservations_per_caller)
        core.on_kv = KVTransferMetrics(metrics).observe
        offered = tuple(limits["kv_transports"])
        decode = DecodeWorker(
            core,
            registry,
            DecodeSettings(
                service.worker_id,
                address,
                lease_s=worker.lease_s,
                kv_transports=offered,
                stream_interval=worker.stream_interval,
            ),
            reservations,
        )
        stats = _stats_of(core)
        metrics.registry.register(EngineCollector(stats, metrics.model_name))
        requests = RequestMetrics(
            metrics, ("inter_token_latency", "e2e_request_latency"), outcomes=True
        )
        observer = DecodeObserver(tracing, requests, metrics.model_name)
        opened.gates[0].bind(DecodeServicer(decode, observer))
        # NOTE: the heartbeat never waits on a step; a loop that stops turning takes the worker
        # out of the registry (runtime/engine_watch.py)
        watch = EngineWatch(functools.partial(core.submit, "stats"), worker.engine_stall_s)
        presence = Presence(
            registry,
            lambda: worker_info(kind, service.worker_id, address, watch.latest(), offered, limits),
            ttl_s=worker.heartbeat_ttl_s,
            interval_s=worker.heartbeat_ttl_s / 6,
            on_tick=decode.housekeeping,
            kv_endpoint=endpoint_from_wire(limits["kv_endpoint"]),
            on_rejoin=decode.republish_prefix_index,
        ).start()
        _when_core_dies(core, opened, presence, on_core_death)
    except BaseException:
        if core is not None:
            core.stop()
        opened.close()
        raise
    # NOTE: a reservation waits for its Decode call; draining must not end in between.
    opened.lifecycle.also_wait_for(lambda: len(decode.reservations))
    opened.lifecycle.set_serving()
    engine_core = core

    def stop() -> None:
        opened.lifecycle.start_draining()
        presence.stop()
        decode.leave_prefix_index()
        opened.server.stop()
        engine_core.stop()
        registry.close()
        metrics.close()

    return Running(opened.server, address, opened.lifecycle, metrics, stop, presence.leave, decode)


def start_prefill(
    service: ServiceSettings,
    worker: WorkerSettings,
    tracing: Tracing | None = None,
    security: Security | None = None,
    on_core_death: Callable[[BaseException], None] | None = None,
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
        metrics_secret=security.metrics_secret(service.metrics_bind_host, service.metrics_port),
    )
    address, metrics = opened.address, opened.metrics
    core: EngineCoreClient | None = None
    try:
        core = _start_core("prefill", service, worker, tracing, security, None)
        limits = core.info
        core.on_kv = KVTransferMetrics(metrics).observe
        registry = Registry(
            service.redis_url, retry_s=service.registry_retry_s, secret=security.cluster_secret
        )
        senders = Senders(
            limits["kv_transports"], endpoint_from_wire(limits["kv_endpoint"]), registry
        )
        requests = RequestMetrics(
            metrics, ("request_queue_time", "request_prefill_time"), outcomes=False
        )
        observer = PrefillObserver(tracing, requests, metrics.model_name)
        prefill = PrefillWorker(
            core,
            registry,
            senders,
            PrefillSettings(service.worker_id, lease_s=worker.lease_s),
            observer,
        )
        stats = _stats_of(core)
        metrics.registry.register(EngineCollector(stats, metrics.model_name))
        servicer = PrefillServicer(prefill, tracing)
        opened.gates[0].bind(servicer)
        # NOTE: Prefill is refused until `set_serving`, after `start` wrote this record: a
        # decode worker that reads the registry on a sender's first push finds its name.
        watch = EngineWatch(functools.partial(core.submit, "stats"), worker.engine_stall_s)
        presence = Presence(
            registry,
            lambda: worker_info(
                "prefill", service.worker_id, address, watch.latest(), senders.names, limits
            ),
            ttl_s=worker.heartbeat_ttl_s,
            interval_s=worker.heartbeat_ttl_s / 6,
            kv_endpoint=senders.endpoint(),
        ).start()
        _when_core_dies(core, opened, presence, on_core_death)
    except BaseException:
        if core is not None:
            core.stop()
        opened.close()
        raise
    opened.lifecycle.set_serving()
    engine_core = core

    def stop() -> None:
        opened.lifecycle.start_draining()
        presence.stop()
        opened.server.stop()
        servicer.close()
        engine_core.stop()
        registry.close()
        metrics.close()

    return Running(opened.server, address, opened.lifecycle, metrics, stop, presence.leave, prefill)
