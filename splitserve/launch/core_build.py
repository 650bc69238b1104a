"""What a worker's engine core builds and serves in its own process: its engine's loop and its
role's handler, with the KV transports started (`engine_core.run_core` is the entry point)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from splitserve.decode_service.core import DecodeCoreHandler
from splitserve.decode_service.reservations import ReservationBook
from splitserve.engine.engine_loop import EngineLoop
from splitserve.kv_transfer.transport import KVReceiver
from splitserve.launch.engine_core import CoreSpec
from splitserve.launch.kv_transports import start_core_receivers, start_core_senders
from splitserve.launch.workers import build_engine
from splitserve.prefill_service.core import PrefillCoreHandler
from splitserve.runtime.engine_core.server import CoreHandler, Emitter, serve
from splitserve.runtime.tracing import Tracing, make_tracing

BuildCore = Callable[[CoreSpec, Emitter], tuple[EngineLoop, CoreHandler]]
"""What a core serves, built in its process: its engine's loop and its role's handler."""


def serve_core(
    build: BuildCore, spec: CoreSpec, command_address: str, event_address: str, own_process: bool
) -> None:
    """Serve what `build` makes of `spec` (in a process of its own: its logging set up first)."""
    if own_process:
        logging.basicConfig(
            level=os.environ.get("SPLITSERVE_LOG_LEVEL", "WARNING").upper(),
            format=f"%(asctime)s {spec.role}-core %(levelname)s %(name)s: %(message)s",
        )
    serve(functools.partial(build, spec), command_address, event_address, own_process)


def core_tracing(spec: CoreSpec) -> Tracing:
    """The core's tracing: the front's settings, or none."""
    return make_tracing(*spec.tracing) if spec.tracing is not None else Tracing.disabled()


def report_failure(emitter: Emitter) -> Callable[[BaseException], None]:
    """The engine loop's `on_failure`: the front hears of it (and the worker dies with it)."""

    def failed(exc: BaseException) -> None:
        emitter.send(["failed", repr(exc)])

    return failed


def prefill_handler(
    loop: EngineLoop, emitter: Emitter, spec: CoreSpec, tracing: Tracing
) -> PrefillCoreHandler:
    """The prefill commands on `loop`, with this worker's KV senders started."""
    connector = loop.engine.kv_connector
    senders = start_core_senders(
        spec.service, spec.worker, connector, spec.cluster_secret, tracing, emitter.kv
    )
    return PrefillCoreHandler(loop, emitter, senders, tracing)


def decode_handler(
    loop: EngineLoop, emitter: Emitter, spec: CoreSpec, tracing: Tracing, receives: bool = True
) -> DecodeCoreHandler:
    """The decode commands on `loop`: a reservation book and, if it `receives` KV (a colocated
    worker does not), this worker's KV receivers started, landing in that book."""
    book = ReservationBook()  # NOTE: per-caller limits are counted in the front
    receivers: list[KVReceiver] = []
    offered: tuple[str, ...] = ()
    if receives:
        connector = loop.engine.kv_connector
        receivers, offered = start_core_receivers(
            spec.service, spec.worker, connector, book, spec.cluster_secret, tracing, emitter.kv
        )
    return DecodeCoreHandler(loop, emitter, book, receivers, tuple(offered))


def build_core(spec: CoreSpec, emitter: Emitter) -> tuple[EngineLoop, CoreHandler]:
    tracing = core_tracing(spec)
    failed = report_failure(emitter)
    engine = build_engine(spec.service, spec.worker, record_prefix_events=True)
    if spec.role == "prefill":
        loop = EngineLoop(engine, on_failure=failed).start()
        return loop, prefill_handler(loop, emitter, spec, tracing)
    loop = EngineLoop(engine, sink=emitter.outputs, on_failure=failed).start()
    return loop, decode_handler(loop, emitter, spec, tracing, receives=spec.role != "colocated")
