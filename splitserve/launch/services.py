"""Starting each kind of service in this process: decode (or colocated), prefill, gateway.

Each starts its gRPC server first (health NOT_SERVING; every method answers UNAVAILABLE
"loading") and its /metrics endpoint, then loads what it serves, binds the real servicers, joins
the registry and turns SERVING (the steps every worker shares are in `worker_start.py`, those
of every worker that serves decode in `decode_start.py`). `Running.drain` then
`Running.stop` is the graceful way out. A worker's engine runs in its engine core
(`engine_core.py`), a process of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.decode_service.prefix_mirror import PrefixMirror
from splitserve.decode_service.servicer import DecodeServicer
from splitserve.decode_service.worker import DecodeWorker
from splitserve.kv_transfer.presence import Presence
from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.launch.decode_start import DecodeWired, start_decode_worker
from splitserve.launch.gateway_service import GATEWAY_SERVICE as GATEWAY_SERVICE
from splitserve.launch.gateway_service import start_gateway as start_gateway
from splitserve.launch.gateway_service import start_http as start_http
from splitserve.launch.worker_record import worker_info
from splitserve.launch.worker_start import Loaded, Served, prefill_worker, start_worker
from splitserve.prefill_service.pusher import Senders
from splitserve.prefill_service.servicer import PrefillServicer
from splitserve.protos.v1 import worker_pb2_grpc
from splitserve.runtime.engine_core.protocol import endpoint_from_wire
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Running, ServiceSpec
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing

PREFILL_SERVICE = "splitserve.v1.PrefillWorker"
DECODE_SERVICE = "splitserve.v1.DecodeWorker"


def start_decode(
    service: ServiceSettings,
    worker: WorkerSettings,
    kind: str = "decode",
    tracing: Tracing | None = None,
    security: Security | None = None,
    on_core_death: Callable[[BaseException], None] | None = None,
) -> Running:
    """A decode worker (kind "decode"), or a colocated one that also prefills ("colocated")."""

    def wire(loaded: Loaded, decode: DecodeWorker, servicer: DecodeServicer) -> DecodeWired:
        loaded.opened.gates[0].bind(servicer)
        offered = tuple(loaded.limits["kv_transports"])
        return DecodeWired(decode, kind=lambda: kind, transports=lambda: offered)

    add = worker_pb2_grpc.add_DecodeWorkerServicer_to_server
    specs = [ServiceSpec(DECODE_SERVICE, add, ("Reserve",))]
    return start_decode_worker(
        service,
        worker,
        kind,
        specs,
        wire,
        tracing=tracing or Tracing.disabled(),
        security=security or Security(),
        on_core_death=on_core_death,
    )


def start_prefill(
    service: ServiceSettings,
    worker: WorkerSettings,
    tracing: Tracing | None = None,
    security: Security | None = None,
    on_core_death: Callable[[BaseException], None] | None = None,
) -> Running:
    """A prefill worker: prefills on its engine core and pushes the KV to decode workers."""
    traced = tracing or Tracing.disabled()

    def wire(loaded: Loaded) -> Served:
        opened, limits = loaded.opened, loaded.limits
        senders = Senders(
            limits["kv_transports"], endpoint_from_wire(limits["kv_endpoint"]), loaded.registry
        )
        prefill = prefill_worker(loaded, senders, service, worker, traced, opened.metrics)
        servicer = PrefillServicer(prefill, traced)
        opened.gates[0].bind(servicer)

        def info() -> WorkerInfo:
            return worker_info(
                "prefill", service.worker_id, opened.address, loaded.watch, senders.names, limits
            )

        # Its prefix cache in the registry's prefix index: the gateway sends a prompt to the
        # prefill worker that already holds its start (gateway/router.py).
        prefix = PrefixMirror(loaded.core, loaded.registry, service.worker_id, worker.lease_s)
        # NOTE: routed only once `start` wrote this record, endpoint first: a decode worker that
        # reads the registry on a sender's first push finds its name.
        presence = Presence(
            loaded.registry,
            info,
            ttl_s=worker.heartbeat_ttl_s,
            interval_s=worker.heartbeat_ttl_s / 6,
            on_tick=prefix.publish,
            kv_endpoint=senders.endpoint(),
            on_rejoin=prefix.republish,
        )
        return Served(prefill, presence, leave=(prefix.leave,), close=(servicer.close,))

    add = worker_pb2_grpc.add_PrefillWorkerServicer_to_server
    specs = [ServiceSpec(PREFILL_SERVICE, add, ("Prefill",))]
    return start_worker(
        service,
        worker,
        "prefill",
        specs,
        wire,
        tracing=traced,
        security=security or Security(),
        detokenizes=False,
        on_core_death=on_core_death,
    )
