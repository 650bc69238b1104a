"""`splitserve up`: Redis, prefill and decode workers and the gateway, as real processes.

Starts its own `redis-server` on a free port unless given a URL (in a session of its own, like
the services: see `redis_keeper`), builds the tiny default model
if none is given, waits until every worker has registered and the gateway is serving, prints
the address, and on Ctrl-C (or SIGTERM) stops everything it started: the gateway first (it
drains: the requests in flight finish), then the workers (they drain too).

Every service gets an explicit free port (and, with `metrics`, a free /metrics port), so that
its health can be watched from the moment it starts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.kv_transfer.registry import Registry
from splitserve.runtime.redis_keeper import RedisKeeper


@dataclass(frozen=True)
class StackSettings:
    model: str | None = None
    prefill: int = 1
    decode: int = 1
    port: int = 0
    host: str = "127.0.0.1"
    redis_url: str | None = None
    extra_worker_args: tuple[str, ...] = ()
    extra_gateway_args: tuple[str, ...] = ()
    startup_timeout_s: float = 180.0
    metrics: bool = False  # each service serves /metrics on a free port (`Stack.metrics_ports`)
    drain_timeout_s: float = 30.0
    env: Mapping[str, str] = field(default_factory=dict)  # added to every service's environment
    # Devices handed to the workers in turn, decode (or colocated) workers first, then prefill
    # ones; empty: each worker picks (the GPU when there is one).
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("need --decode >= 1 and --prefill >= 0 (0 means colocated)")


@dataclass
class Stack:
    """A running stack; `stop()` tears it down in reverse order."""

    address: str
    redis_url: str
    model: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    redis: RedisKeeper | None = None
    ports: dict[str, int] = field(default_factory=dict)  # "decode-0", "gateway" … -> gRPC port
    metrics_ports: dict[str, int] = field(default_factory=dict)  # the same names -> /metrics
    stop_timeout_s: float = 35.0

    def process(self, name: str) -> subprocess.Popen:
        """The process of service `name` ("gateway", "decode-0", "prefill-1", …)."""
        return next(p for p in self.processes if _service_id(p) == name)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the gateway and wait for it to drain, then the workers; kill what is still
        running after `timeout_s`."""
        deadline = time.monotonic() + (timeout_s or self.stop_timeout_s)
        gateways = [p for p in self.processes if _name(p) == "gateway"]
        workers = [p for p in self.processes if _name(p) != "gateway"]
        for group in (gateways, workers):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.redis is not None:
            self.redis.stop()


def _name(proc: subprocess.Popen) -> str:
    """The service a child runs: `python -m splitserve.cli <service> …`."""
    return str(cast(list[str], proc.args)[3])


def _service_id(proc: subprocess.Popen) -> str:
    args = cast(list[str], proc.args)
    return args[args.index("--worker-id") + 1] if "--worker-id" in args else _name(proc)


def default_model_dir() -> Path:
    """Where the tiny default model is built (and reused) when no --model is given."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitserve" / "tiny-llama"


def ensure_default_model() -> str:
    from splitserve.testing.tiny_model import make_tiny_model

    path = default_model_dir()
    if not (path / "config.json").is_file():
        make_tiny_model(path, "llama")
    return str(path)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _new_port(host: str, taken: set[int]) -> int:
    """A free port not yet handed to another service of this stack."""
    while (port := free_port(host)) in taken:
        pass
    taken.add(port)
    return port


def start_stack(settings: StackSettings, wait: bool = True) -> Stack:
    """Start the stack; with `wait`, return once it is ready (else call `wait_ready`)."""
    model = settings.model or ensure_default_model()
    redis = None
    redis_url = settings.redis_url
    if redis_url is None:
        redis = RedisKeeper()
        redis_url = redis.url
    port = settings.port or free_port(settings.host)
    stack = Stack(
        f"{settings.host}:{port}",
        redis_url,
        model,
        redis=redis,
        stop_timeout_s=settings.drain_timeout_s + 5.0,
    )
    env = {**os.environ, **settings.env}
    common = [
        "--model", model, "--redis-url", redis_url, "--host", settings.host,
        "--drain-timeout-s", str(settings.drain_timeout_s),
    ]  # fmt: skip
    decode_kind = ["--colocated"] if settings.prefill == 0 else []
    services = [
        ("decode", f"decode-{i}", [*decode_kind, *settings.extra_worker_args])
        for i in range(settings.decode)
    ]
    services += [
        ("prefill", f"prefill-{i}", list(settings.extra_worker_args))
        for i in range(settings.prefill)
    ]
    services.append(("gateway", "gateway", list(settings.extra_gateway_args)))
    try:
        taken = {port}
        for i, (kind, name, extra) in enumerate(services):
            stack.ports[name] = port if kind == "gateway" else _new_port(settings.host, taken)
            args = [kind, *common, "--port", str(stack.ports[name])]
            if kind != "gateway":
                args += ["--worker-id", name]
                if settings.devices:
                    args += ["--device", settings.devices[i % len(settings.devices)]]
            if settings.metrics:
                stack.metrics_ports[name] = _new_port(settings.host, taken)
                args += ["--metrics-port", str(stack.metrics_ports[name])]
            # NOTE: a session of their own, so that a Ctrl-C at the terminal reaches only
            # `splitserve up`, which stops the gateway before the workers.
            stack.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "splitserve.cli", *args, *extra],
                    env=env,
                    start_new_session=True,
                )
            )
        if wait:
            wait_ready(stack, settings)
    except BaseException:
        stack.stop()
        raise
    return stack


def wait_ready(stack: Stack, settings: StackSettings) -> None:
    """Until every worker has registered and the gateway is SERVING."""
    registry = Registry(stack.redis_url)
    deadline = time.monotonic() + settings.startup_timeout_s
    decode_kind = "colocated" if settings.prefill == 0 else "decode"
    try:
        while time.monotonic() < deadline:
            dead = [_name(p) for p in stack.processes if p.poll() is not None]
            if dead:
                raise RuntimeError(f"service(s) exited during start-up: {dead}")
            ready = (
                len(registry.live_workers(decode_kind)) >= settings.decode
                and len(registry.live_workers("prefill")) >= settings.prefill
                and _serving(stack.address)
            )
            if ready:
                return
            time.sleep(0.2)
        raise TimeoutError(f"the stack was not ready within {settings.startup_timeout_s:.0f} s")
    finally:
        registry.close()


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def run_until_interrupted(settings: StackSettings) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"starting splitserve: {settings.prefill} prefill, {settings.decode} decode …", flush=True
    )
    stack = start_stack(settings)
    print(
        f"splitserve is serving on {stack.address} (model {stack.model}, redis {stack.redis_url})"
    )
    for name, port in stack.metrics_ports.items():
        print(f"  {name} metrics: http://{settings.host}:{port}/metrics")
    print("press Ctrl-C to stop", flush=True)
    try:
        while not stop.wait(0.5):
            dead = [_name(p) for p in stack.processes if p.poll() is not None]
            if dead:
                print(f"service(s) exited: {dead}; shutting down", file=sys.stderr)
                return 1
    finally:
        print("stopping …", flush=True)
        stack.stop()
        print("stopped", flush=True)
    return 0
