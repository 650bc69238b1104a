"""A worker's engine core process: what the front hands it (`CoreSpec`) and its entry point
(`run_core`). What the core builds and serves is in `core_build.py`, imported only in the core's
own process, so that a worker's front never loads torch or the engine. The protocol is in
`runtime/engine_core/`, each role's commands in `decode_service/core.py` and
`prefill_service/core.py`; a `--role-switch` worker's core is built from the same parts
(`splitserve/roles/switchable_core.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.runtime.settings import ServiceSettings, TracingSettings, WorkerSettings


@dataclass(frozen=True)
class CoreSpec:
    """What the core process needs to build itself (handed to it once, at spawn)."""

    role: str  # decode | colocated | prefill | switchable (--role-switch: any of them)
    service: ServiceSettings
    worker: WorkerSettings
    cluster_secret: str = field(default="", repr=False)
    tracing: tuple[TracingSettings, str, str] | None = None


def run_core(spec: CoreSpec, command_address: str, event_address: str, own_process: bool) -> None:
    """The entry point of a prefill, decode or colocated worker's core (`EngineCoreClient`
    starts it)."""
    # NOTE: here, so that the engine (and torch) load in the core's process, never the front's
    from splitserve.launch.core_build import build_core, serve_core

    serve_core(build_core, spec, command_address, event_address, own_process)
