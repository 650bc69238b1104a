"""Starting a worker whose role can change in place (`splitserve decode|prefill --role-switch`):
one engine core with both roles' commands (`switchable_core.py`), both worker services and the
`WorkerRole` service on one gRPC server, the role guard in front (`role_switch.py`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from splitserve.decode_service.observer import DecodeObserver
from splitserve.decode_service.reservations import ReservationBook
from splitserve.decode_service.servicer import DecodeServicer
from splitserve.decode_service.worker import DecodeSettings, DecodeWorker
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.kv_transfer.registry import Registry
from splitserve.prefill_service.observer import PrefillObserver
from splitserve.prefill_service.pusher import Senders
from splitserve.prefill_service.servicer import PrefillServicer
from splitserve.prefill_service.worker import PrefillSettings, PrefillWorker
from splitserve.protos.v1 import worker_pb2_grpc
from splitserve.role_switch import RolePresence, RoleServicer, RoleSwitch
from splitserve.runtime.engine_core.client import EngineCoreClient
from splitserve.runtime.engine_core.protocol import endpoint_from_wire
from splitserve.runtime.engine_metrics import EngineCollector
from splitserve.runtime.engine_watch import EngineWatch
from splitserve.runtime.metrics import KVTransferMetrics, RequestMetrics
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Running, ServiceSpec, open_service
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing
from splitserve.services import (
    DECODE_SERVICE,
    PREFILL_SERVICE,
    _start_core,
    _stats_of,
    _when_core_dies,
)
from splitserve.workers import worker_info

ROLE_SERVICE = "splitserve.v1.WorkerRole"


def start_switchable(
    service: ServiceSettings,
    worker: WorkerSettings,
    kind: str,
    tracing: Tracing | None = None,
    security: Security | None = None,
    on_core_death: Callable[[BaseException], None] | None = None,
) -> Running:
    """A worker that starts as `kind` (prefill, decode or colocated) and changes role on a
    `WorkerRole.SetRole` call. `Running.worker` is its `RoleSwitch`."""
    tracing = tracing or Tracing.disabled()
    security = security or Security()
    opened = open_service(
        service,
        [
            ServiceSpec(
                DECODE_SERVICE, worker_pb2_grpc.add_DecodeWorkerServicer_to_server, ("Reserve",)
            ),
            ServiceSpec(
                PREFILL_SERVICE, worker_pb2_grpc.add_PrefillWorkerServicer_to_server, ("Prefill",)
            ),
            ServiceSpec(ROLE_SERVICE, worker_pb2_grpc.add_WorkerRoleServicer_to_server),
        ],
        interceptors=security.worker_interceptors(),
        metrics_secret=security.metrics_secret(service.metrics_bind_host, service.metrics_port),
    )
    address, metrics = opened.address, opened.metrics
    core: EngineCoreClient | None = None
    try:
        core = _start_core(
            "switchable", service, worker, tracing, security, load_tokenizer(service.model)
        )
        limits = core.info
        core.on_kv = KVTransferMetrics(metrics).observe
        registry = Registry(
            service.redis_url, retry_s=service.registry_retry_s, secret=security.cluster_secret
        )
        received = tuple(limits["kv_transports"])
        senders = Senders(
            limits["send_transports"], endpoint_from_wire(limits["kv_endpoint"]), registry
        )
        decode = DecodeWorker(
            core,
            registry,
            DecodeSettings(
                service.worker_id,
                address,
                lease_s=worker.lease_s,
                kv_transports=received,
                stream_interval=worker.stream_interval,
            ),
            ReservationBook(per_caller=worker.max_reservations_per_caller),
        )
        prefill = PrefillWorker(
            core,
            registry,
            senders,
            PrefillSettings(service.worker_id, lease_s=worker.lease_s),
            PrefillObserver(
                tracing,
                RequestMetrics(
                    metrics, ("request_queue_time", "request_prefill_time"), outcomes=False
                ),
                metrics.model_name,
            ),
        )
        stats = _stats_of(core)
        metrics.registry.register(EngineCollector(stats, metrics.model_name))
        requests = RequestMetrics(
            metrics, ("inter_token_latency", "e2e_request_latency"), outcomes=True
        )
        switch = RoleSwitch(kind, decode, prefill, drain_timeout_s=service.drain_timeout_s)
        prefill_servicer = PrefillServicer(prefill, tracing)
        opened.gates[0].bind(
            switch.guard(
                DecodeServicer(decode, DecodeObserver(tracing, requests, metrics.model_name))
            )
        )
        opened.gates[1].bind(switch.guard(prefill_servicer))
        opened.gates[2].bind(RoleServicer(switch))

        # NOTE: the heartbeat never waits on a step (runtime/engine_watch.py)
        watch = EngineWatch(functools.partial(core.submit, "stats"), worker.engine_stall_s)

        def info() -> object:
            transports = senders.names if switch.kind == "prefill" else received
            return worker_info(
                switch.kind, service.worker_id, address, watch.latest(), transports, limits
            )

        presence = RolePresence(
            registry,
            info,  # type: ignore[arg-type]
            ttl_s=worker.heartbeat_ttl_s,
            interval_s=worker.heartbeat_ttl_s / 6,
            on_tick=decode.housekeeping,
            kv_endpoint=endpoint_from_wire(limits["kv_endpoint"]),
            on_rejoin=decode.republish_prefix_index,
        )
        presence.start()
        switch.presence = presence
        _when_core_dies(core, opened, presence, on_core_death)
    except BaseException:
        if core is not None:
            core.stop()
        opened.close()
        raise
    opened.lifecycle.also_wait_for(lambda: len(decode.reservations))
    opened.lifecycle.set_serving()
    engine_core = core

    def stop() -> None:
        opened.lifecycle.start_draining()
        presence.stop()
        decode.leave_prefix_index()
        opened.server.stop()
        prefill_servicer.close()
        engine_core.stop()
        registry.close()
        metrics.close()

    return Running(opened.server, address, opened.lifecycle, metrics, stop, presence.leave, switch)
