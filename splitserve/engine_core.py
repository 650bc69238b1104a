"""A worker's engine core process: what it builds and serves (the wiring; the protocol is in
`runtime/engine_core/`, each role's commands in `decode_service/core.py` and
`prefill_service/core.py`)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field

from splitserve.decode_service.core import DecodeCoreHandler
from splitserve.decode_service.reservations import ReservationBook
from splitserve.engine.engine_loop import EngineLoop
from splitserve.kv_transfer.transport import KVReceiver
from splitserve.kv_transports import start_core_receivers, start_core_senders
from splitserve.prefill_service.core import PrefillCoreHandler
from splitserve.runtime.engine_core.server import CoreHandler, Emitter, serve
from splitserve.runtime.settings import ServiceSettings, TracingSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing, make_tracing
from splitserve.switchable_core import build_switchable
from splitserve.workers import build_engine


@dataclass(frozen=True)
class CoreSpec:
    """What the core process needs to build itself (handed to it once, at spawn)."""

    role: str  # decode | colocated | prefill | switchable (--role-switch: any of them)
    service: ServiceSettings
    worker: WorkerSettings
    cluster_secret: str = field(default="", repr=False)
    tracing: tuple[TracingSettings, str, str] | None = None


def run_core(spec: CoreSpec, command_address: str, event_address: str, own_process: bool) -> None:
    """The core's entry point (`EngineCoreClient` starts it)."""
    if own_process:
        logging.basicConfig(
            level=os.environ.get("SPLITSERVE_LOG_LEVEL", "WARNING").upper(),
            format=f"%(asctime)s {spec.role}-core %(levelname)s %(name)s: %(message)s",
        )
    serve(functools.partial(_build, spec), command_address, event_address, own_process)


def _build(spec: CoreSpec, emitter: Emitter) -> tuple[EngineLoop, CoreHandler]:
    service, worker = spec.service, spec.worker
    tracing = make_tracing(*spec.tracing) if spec.tracing is not None else Tracing.disabled()

    def failed(exc: BaseException) -> None:
        emitter.send(["failed", repr(exc)])

    engine = build_engine(service, worker, record_prefix_events=spec.role != "prefill")
    if spec.role == "switchable":  # --role-switch: both roles' commands on one engine
        return build_switchable(
            engine, emitter, service, worker, spec.cluster_secret, tracing, failed
        )
    if spec.role == "prefill":
        loop = EngineLoop(engine, on_failure=failed).start()
        senders = start_core_senders(
            service, worker, engine.kv_connector, spec.cluster_secret, tracing, emitter.kv
        )
        return loop, PrefillCoreHandler(loop, emitter, senders, tracing)
    loop = EngineLoop(engine, sink=emitter.outputs, on_failure=failed).start()
    book = ReservationBook()  # NOTE: per-caller limits are counted in the front
    receivers: list[KVReceiver] = []
    offered: tuple[str, ...] = ()
    if spec.role != "colocated":
        receivers, offered = start_core_receivers(
            service, worker, engine.kv_connector, book, spec.cluster_secret, tracing, emitter.kv
        )
    return loop, DecodeCoreHandler(loop, emitter, book, receivers, tuple(offered))
