"""Starting a worker whose role can change in place (`splitserve decode|prefill --role-switch`):
one engine core with both roles' commands (`switchable_core.py`), both worker services and the
`WorkerRole` service on one gRPC server, the role guard in front (`role_switch.py`). Its KV
senders also hand off the KV of the streams it moves off as it leaves decode
(`decode_service/handoff.py`)."""

from __future__ import annotations

from collections.abc import Callable

from splitserve.decode_service.handoff import KVRoute
from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.kv_transfer.transport import Peer
from splitserve.prefill_service.pusher import Senders
from splitserve.prefill_service.servicer import PrefillServicer
from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
from splitserve.role_switch import RolePresence, RoleServicer, RoleSwitch
from splitserve.runtime.engine_core.protocol import endpoint_from_wire
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Running, ServiceSpec
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing
from splitserve.services import DECODE_SERVICE, PREFILL_SERVICE
from splitserve.worker_start import (
    Loaded,
    Served,
    decode_presence,
    decode_servicer,
    decode_worker,
    prefill_worker,
    serving_decode,
    start_worker,
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
    traced = tracing or Tracing.disabled()

    def wire(loaded: Loaded) -> Served:
        opened, limits = loaded.opened, loaded.limits
        received = tuple(limits["kv_transports"])
        senders = Senders(
            limits["send_transports"], endpoint_from_wire(limits["kv_endpoint"]), loaded.registry
        )
        decode = decode_worker(loaded, service, worker)
        prefill = prefill_worker(loaded, senders, service, worker, traced, opened.metrics)

        def kv_route(destination: worker_pb2.KVDestination) -> tuple[str, Peer]:
            route = senders.route(destination)
            return route.transport, route.peer

        # NOTE: streams it moves off as it leaves decode hand their KV off with its senders
        decode.handoffs.route = KVRoute(kv_route, prefill.settings.send_timeout_s)
        switch = RoleSwitch(kind, decode, prefill, drain_timeout_s=service.drain_timeout_s)
        prefill_servicer = PrefillServicer(prefill, traced)
        opened.gates[0].bind(switch.guard(decode_servicer(decode, traced, opened.metrics)))
        opened.gates[1].bind(switch.guard(prefill_servicer))
        opened.gates[2].bind(RoleServicer(switch))

        def info() -> WorkerInfo:
            transports = senders.names if switch.kind == "prefill" else received
            return worker_info(
                switch.kind,
                service.worker_id,
                opened.address,
                loaded.watch,
                transports,
                limits,
            )

        presence = decode_presence(RolePresence, loaded, info, worker, decode)
        switch.presence = presence
        return serving_decode(switch, presence, decode, close=(prefill_servicer.close,))

    specs = [
        ServiceSpec(
            DECODE_SERVICE, worker_pb2_grpc.add_DecodeWorkerServicer_to_server, ("Reserve",)
        ),
        ServiceSpec(
            PREFILL_SERVICE, worker_pb2_grpc.add_PrefillWorkerServicer_to_server, ("Prefill",)
        ),
        ServiceSpec(ROLE_SERVICE, worker_pb2_grpc.add_WorkerRoleServicer_to_server),
    ]
    return start_worker(
        service,
        worker,
        "switchable",
        specs,
        wire,
        tracing=traced,
        security=security or Security(),
        detokenizes=True,
        on_core_death=on_core_death,
    )
