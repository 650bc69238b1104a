"""Starting a worker whose role can change in place (`splitserve decode|prefill --role-switch`):
one engine core with both roles' commands (`switchable_core.py`), both worker services and the
`WorkerRole` service on one gRPC server, the role guard in front (`switch.py`). Its KV
senders also hand off the KV of the streams it moves off as it leaves decode
(`decode_service/handoff.py`)."""

from __future__ import annotations

from collections.abc import Callable

from splitserve.decode_service.handoff import KVRoute
from splitserve.decode_service.servicer import DecodeServicer
from splitserve.decode_service.worker import DecodeWorker
from splitserve.kv_transfer.transport import Peer
from splitserve.launch.decode_start import DecodeWired, start_decode_worker
from splitserve.launch.engine_core import CoreSpec
from splitserve.launch.services import DECODE_SERVICE, PREFILL_SERVICE
from splitserve.launch.worker_start import Loaded, prefill_worker
from splitserve.prefill_service.pusher import Senders
from splitserve.prefill_service.servicer import PrefillServicer
from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
from splitserve.roles.switch import RoleServicer, RoleSwitch
from splitserve.runtime.engine_core.protocol import endpoint_from_wire
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Running, ServiceSpec
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing

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

    def wire(loaded: Loaded, decode: DecodeWorker, servicer: DecodeServicer) -> DecodeWired:
        opened, limits = loaded.opened, loaded.limits
        received = tuple(limits["kv_transports"])
        senders = Senders(
            limits["send_transports"], endpoint_from_wire(limits["kv_endpoint"]), loaded.registry
        )
        prefill = prefill_worker(loaded, senders, service, worker, traced, opened.metrics)

        def kv_route(destination: worker_pb2.KVDestination) -> tuple[str, Peer]:
            route = senders.route(destination)
            return route.transport, route.peer

        # NOTE: streams it moves off as it leaves decode hand their KV off with its senders
        decode.handoffs.route = KVRoute(kv_route, prefill.settings.send_timeout_s)
        switch = RoleSwitch(kind, decode, prefill, drain_timeout_s=service.drain_timeout_s)
        prefill_servicer = PrefillServicer(prefill, traced)
        opened.gates[0].bind(switch.guard(servicer))
        opened.gates[1].bind(switch.guard(prefill_servicer))
        opened.gates[2].bind(RoleServicer(switch))

        def transports() -> tuple[str, ...]:
            return senders.names if switch.kind == "prefill" else received

        return DecodeWired(
            switch,
            kind=lambda: switch.kind,
            transports=transports,
            presence=switch.heartbeat,
            close=(prefill_servicer.close,),
        )

    specs = [
        ServiceSpec(
            DECODE_SERVICE, worker_pb2_grpc.add_DecodeWorkerServicer_to_server, ("Reserve",)
        ),
        ServiceSpec(
            PREFILL_SERVICE, worker_pb2_grpc.add_PrefillWorkerServicer_to_server, ("Prefill",)
        ),
        ServiceSpec(ROLE_SERVICE, worker_pb2_grpc.add_WorkerRoleServicer_to_server),
    ]
    return start_decode_worker(
        service,
        worker,
        "switchable",
        specs,
        wire,
        tracing=traced,
        security=security or Security(),
        on_core_death=on_core_death,
        core_entry=run_switchable_core,
    )


def run_switchable_core(
    spec: CoreSpec, command_address: str, event_address: str, own_process: bool
) -> None:
    """The entry point of a `--role-switch` worker's core (`EngineCoreClient` starts it): the
    engine is imported here, in the core's process, never in the front."""
    from splitserve.launch.core_build import serve_core
    from splitserve.roles.switchable_core import build_switchable

    serve_core(build_switchable, spec, command_address, event_address, own_process)
