"""The scaffolding of a service process: its gRPC server up before anything is loaded (health
NOT_SERVING, every method answering UNAVAILABLE "loading" through a `GatedServicer`), its
/metrics endpoint, and the handle of the running service (`Running`: drain, then stop).

The server runs on an asyncio event loop of its own thread (`runtime/grpc_server.py`); the rest
of the process, this handle included, stays synchronous."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from splitserve.runtime.grpc_server import Server, start_server
from splitserve.runtime.lifecycle import GatedServicer, Lifecycle
from splitserve.runtime.metrics import Metrics
from splitserve.runtime.settings import ServiceSettings


@dataclass(frozen=True)
class ServiceSpec:
    """A gRPC service to serve: its name, its generated `add_*_to_server`, and the methods
    that take new work (refused while draining)."""

    name: str
    add: Callable[[Any, grpc.aio.Server], None]
    admitting: tuple[str, ...] = ()


@dataclass
class Running:
    """A started service: where it listens, how to drain it and how to stop it."""

    server: Server
    address: str
    lifecycle: Lifecycle
    metrics: Metrics
    stop: Callable[[], None]
    leave: Callable[[], None] = lambda: None  # leave the registry (workers)
    worker: object = None
    http_port: int = 0  # the gateway's OpenAI-compatible HTTP API (0: none)

    def drain(self, timeout_s: float, interrupt: threading.Event | None = None) -> bool:
        """Refuse new work (health NOT_SERVING), leave the registry, wait for what is in
        flight; False if `timeout_s` ran out (or `interrupt` was set) first."""
        self.lifecycle.start_draining()
        self.leave()
        return self.lifecycle.wait_idle(timeout_s, interrupt)


@dataclass
class Opened:
    """A service's server, up (health NOT_SERVING) before anything is loaded."""

    server: Server
    lifecycle: Lifecycle
    gates: list[GatedServicer]
    metrics: Metrics
    address: str

    def close(self) -> None:
        self.server.stop(0)
        self.metrics.close()


def open_service(
    service: ServiceSettings,
    specs: Sequence[ServiceSpec],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    reuse_port: bool = False,
    metrics_secret: str = "",
) -> Opened:
    """Start the service's gRPC server (its own event loop thread; health NOT_SERVING, every
    method UNAVAILABLE "loading") and its /metrics endpoint. `interceptors` check who calls
    (`runtime/security.py`); `credentials` serve TLS; `reuse_port` shares the port with the
    other processes of one gateway (SO_REUSEPORT). /metrics listens on the service's
    `metrics_bind_host`, for callers that send `metrics_secret` (if any) as a bearer token."""
    lifecycle = Lifecycle([spec.name for spec in specs])
    gates = [lifecycle.gate(spec.admitting) for spec in specs]

    def register(server: grpc.aio.Server) -> None:
        for spec, gate in zip(specs, gates, strict=True):
            spec.add(gate, server)

    server = start_server(
        register,
        [s.name for s in specs],
        service.host,
        service.port,
        interceptors=interceptors,
        credentials=credentials,
        reuse_port=reuse_port,
    )
    lifecycle.attach(server)
    metrics = Metrics(service.served_model_name)
    try:
        metrics.serve(service.metrics_bind_host, service.metrics_port, metrics_secret)
    except BaseException:
        server.stop(0)
        raise
    return Opened(server, lifecycle, gates, metrics, f"{service.public_host}:{server.port}")
