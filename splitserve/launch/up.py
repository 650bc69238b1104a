"""`splitserve up`: Redis, prefill and decode workers and the gateway, as real processes.

Starts its own `redis-server` on a free port unless given a URL (in a session of its own, like
the services: see `redis_keeper`), fetches the default model if none is given
(`default_model`), converts a GGUF checkpoint once (`engine/gguf_cache.py`), waits until
every worker has registered and the gateway is serving, prints the address, and on Ctrl-C
(or SIGTERM) stops everything it started: the gateway first (it drains: the requests in flight
finish), then the workers (they drain too). A second Ctrl-C cuts the drains short: every
service gets its second signal and `HURRY_S` to exit, then is killed.
A Ctrl-C during start-up stops what has started.

Every service gets an explicit free port (and, with `metrics`, a free /metrics port), so that
its health can be watched from the moment it starts (`ports.py`). The running stack and
its stop order are `stack.py`'s `Stack`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.engine.gguf_cache import resolve_checkpoint
from splitserve.kv_transfer.registry import Registry
from splitserve.launch.default_model import ensure_tiny_model, resolve_model_arg
from splitserve.launch.gateway_processes import default_processes
from splitserve.launch.ports import can_listen, new_port, new_ports
from splitserve.launch.ports import free_port as free_port
from splitserve.launch.stack import HURRY_S as HURRY_S
from splitserve.launch.stack import Stack as Stack
from splitserve.launch.stack import service_id, service_name
from splitserve.runtime.redis_keeper import RedisKeeper
from splitserve.runtime.secrets import redacted_url, with_redis_password
from splitserve.runtime.security import is_loopback
from splitserve.runtime.settings import check_port
from splitserve.runtime.stack_secrets import StackSecrets


class StackError(RuntimeError):
    """The stack could not start (a port in use, a service that exited during start-up)."""


@dataclass(frozen=True)
class StackSettings:
    model: str | None = None
    prefill: int = 1
    decode: int = 1
    port: int = 0
    host: str = "127.0.0.1"
    redis_url: str | None = None
    extra_worker_args: tuple[str, ...] = ()
    # After `extra_worker_args`, for one role only (a prefill degree unlike the decode one).
    extra_prefill_args: tuple[str, ...] = ()
    extra_decode_args: tuple[str, ...] = ()
    extra_gateway_args: tuple[str, ...] = ()
    # Gateway processes on its port (`splitserve gateway --processes`; 0: sized to the host,
    # what `splitserve up` asks by default; 1 here, so that a stack's gateway /metrics port
    # shows every request)
    gateways: int = 1
    startup_timeout_s: float = 180.0
    metrics: bool = False  # each service serves /metrics on a free port (`Stack.metrics_ports`)
    drain_timeout_s: float = 30.0
    env: Mapping[str, str] = field(default_factory=dict)  # added to every service's environment
    # Devices handed to the workers in turn, decode (or colocated) workers first, then prefill
    # ones; empty: each worker picks (the GPU when there is one).
    devices: tuple[str, ...] = ()
    # The gateway's OpenAI-compatible HTTP API on this port (0: a free one; None: off).
    http_port: int | None = None
    # Security (docs/deploy.md). The gateway's API keys (handed over in a file) and TLS files;
    # a fresh cluster secret between the services (None: when `host` is not loopback or keys
    # are given); Redis, when started here, always gets a fresh password. `insecure`: serve
    # a host other than loopback without API keys.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    cluster_secret: bool | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("need --decode >= 1 and --prefill >= 0 (0 means colocated)")
        if not (is_loopback(self.host) or self.api_keys or self.insecure):
            raise ValueError(
                f"--host {self.host} would serve anyone who can reach it: give --api-key-file "
                "(and --tls-cert-file/--tls-key-file), or --insecure to serve without a key"
            )
        plaintext_http = self.http_port is not None and not (
            self.tls_cert_file and self.tls_key_file
        )
        if plaintext_http and not (is_loopback(self.host) or self.insecure):
            raise ValueError(
                f"--host {self.host}: the HTTP API would carry API keys and prompts in clear: "
                "give --tls-cert-file/--tls-key-file, or --insecure to serve it without TLS"
            )
        check_port("--port", self.port)
        if self.gateways < 0:
            raise ValueError(f"--gateways must be >= 0 (0: sized to the host), got {self.gateways}")


def ensure_default_model() -> str:
    """The tiny random-weight model's directory (`--model tiny`), built on first use.

    NOTE: the name predates the real default model (`default_model.resolve_model_arg`);
    new code calls `default_model.ensure_tiny_model`."""
    return ensure_tiny_model()


def start_stack(
    settings: StackSettings, wait: bool = True, interrupt: threading.Event | None = None
) -> Stack:
    """Start the stack; with `wait`, return once it is ready (else call `wait_ready`).

    Raises StackError if `settings.port` is in use, and KeyboardInterrupt once `interrupt` is
    set while waiting (what started is stopped either way)."""
    if settings.port and not can_listen(settings.host, settings.port):
        raise StackError(
            f"port {settings.port} on {settings.host} is in use (another splitserve, or another "
            "server?); stop it or pick another --port"
        )
    # NOTE: a GGUF is converted here, once, before the services start (not by each of them).
    model = str(resolve_checkpoint(resolve_model_arg(settings.model)))
    redis = None
    redis_url = settings.redis_url
    secrets = StackSecrets.fresh(
        settings.api_keys,
        settings.cluster_secret,
        own_redis=redis_url is None,
        loopback=is_loopback(settings.host),
    )
    if redis_url is None:
        redis = RedisKeeper(password=secrets.redis_password)
        redis_url = redis.url
    port = settings.port or free_port(settings.host)
    stack = Stack(
        f"{settings.host}:{port}",
        with_redis_password(redis_url, secrets.redis_password),  # NOTE: in memory only
        model,
        redis=redis,
        stop_timeout_s=settings.drain_timeout_s + 5.0,
        secrets=secrets,
    )
    env = {**os.environ, **settings.env}
    common = [
        "--model", model, "--redis-url", redis_url, "--host", settings.host,
        "--drain-timeout-s", str(settings.drain_timeout_s),
        *(["--insecure"] if settings.insecure else []),
    ]  # fmt: skip
    decode_kind = ["--colocated"] if settings.prefill == 0 else []
    services = [
        (
            "decode",
            f"decode-{i}",
            [*decode_kind, *settings.extra_worker_args, *settings.extra_decode_args],
        )
        for i in range(settings.decode)
    ]
    services += [
        ("prefill", f"prefill-{i}", [*settings.extra_worker_args, *settings.extra_prefill_args])
        for i in range(settings.prefill)
    ]
    services.append(("gateway", "gateway", list(settings.extra_gateway_args)))
    try:
        taken = {port}
        for i, (kind, name, extra) in enumerate(services):
            stack.ports[name] = port if kind == "gateway" else new_port(settings.host, taken)
            args = [kind, *common, "--port", str(stack.ports[name])]
            if kind == "gateway" and settings.tls_cert_file and settings.tls_key_file:
                args += ["--tls-cert-file", settings.tls_cert_file]
                args += ["--tls-key-file", settings.tls_key_file]
            if kind != "gateway":
                args += ["--worker-id", name]
                if settings.devices:
                    args += ["--device", settings.devices[i % len(settings.devices)]]
            if kind == "gateway":
                args += ["--processes", str(settings.gateways)]
            if kind == "gateway" and settings.http_port is not None:
                http_port = settings.http_port or new_port(settings.host, taken)
                args += ["--http-port", str(http_port)]
                scheme = "https" if settings.tls_cert_file and settings.tls_key_file else "http"
                stack.http_url = f"{scheme}://{settings.host}:{http_port}/v1"
            if settings.metrics:
                # NOTE: gateway process i serves /metrics on the gateway's port + i
                count = (settings.gateways or default_processes()) if kind == "gateway" else 1
                if kind == "gateway":
                    stack.gateway_processes = count
                stack.metrics_ports[name] = new_ports(settings.host, taken, count)
                args += ["--metrics-port", str(stack.metrics_ports[name])]
            # NOTE: a session of their own, so that a Ctrl-C at the terminal reaches only
            # `splitserve up`, which stops the gateway before the workers.
            stack.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "splitserve.cli", *args, *extra],
                    env={**env, **secrets.service_env(gateway=kind == "gateway")},
                    start_new_session=True,
                )
            )
        if wait:
            wait_ready(stack, settings, interrupt)
    except BaseException:
        stack.stop(settings.drain_timeout_s + 5.0, interrupt)
        raise
    return stack


def wait_ready(
    stack: Stack, settings: StackSettings, interrupt: threading.Event | None = None
) -> None:
    """Until every worker has registered and the gateway is SERVING; KeyboardInterrupt once
    `interrupt` is set."""
    registry = Registry(stack.redis_url)
    deadline = time.monotonic() + settings.startup_timeout_s
    decode_kind = "colocated" if settings.prefill == 0 else "decode"
    try:
        while time.monotonic() < deadline:
            if interrupt is not None and interrupt.is_set():
                raise KeyboardInterrupt
            dead = [service_id(p) for p in stack.processes if p.poll() is not None]
            if dead:
                raise StackError(
                    f"{', '.join(dead)} exited during start-up (its error is above); "
                    "stopped the rest"
                )
            ready = (
                len(registry.live_workers(decode_kind)) >= settings.decode
                and len(registry.live_workers("prefill")) >= settings.prefill
                and _serving(stack.address, _tls_roots(settings))
            )
            if ready:
                return
            time.sleep(0.2)
        raise StackError(f"the stack was not ready within {settings.startup_timeout_s:.0f} s")
    finally:
        registry.close()


def _tls_roots(settings: StackSettings) -> bytes | None:
    """What the readiness probe trusts on a TLS gateway: its certificate file (the chain up
    to its CA)."""
    if not (settings.tls_cert_file and settings.tls_key_file):
        return None
    return Path(settings.tls_cert_file).read_bytes()


def _serving(address: str, tls_roots: bytes | None = None) -> bool:
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_roots))
        if tls_roots is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def run_until_interrupted(settings: StackSettings) -> int:
    """Serve until Ctrl-C (or SIGTERM), then stop in order; a second one cuts the drains
    short. Ctrl-C during start-up stops what started and raises KeyboardInterrupt."""
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(
        f"starting splitserve: {settings.prefill} prefill, {settings.decode} decode …", flush=True
    )
    stack = start_stack(settings, interrupt=stop)
    print(
        f"splitserve is serving on {stack.address} (model {stack.model}, "
        f"redis {redacted_url(stack.redis_url)})"
    )
    if not settings.api_keys:
        where = " (loopback only)" if is_loopback(settings.host) else ""
        print(f"  no API key: anyone who can reach {settings.host} may use it{where}")
    elif not settings.tls_cert_file:
        print("  API keys required; no TLS (give --tls-cert-file/--tls-key-file)")
    if stack.http_url:
        print(f"  OpenAI-compatible API: {stack.http_url}")
    for name, port in stack.metrics_ports.items():
        print(f"  {name} metrics: http://{settings.host}:{port}/metrics")
    print("press Ctrl-C to stop", flush=True)
    try:
        while not stop.wait(0.5):
            dead = [service_name(p) for p in stack.processes if p.poll() is not None]
            if dead:
                print(f"service(s) exited: {dead}; shutting down", file=sys.stderr)
                return 1
    finally:
        print("stopping … (Ctrl-C again to cut the drain short)", flush=True)
        stack.stop(hurry=hurry)
        print("stopped" if not hurry.is_set() else "stopped (drain cut short)", flush=True)
        if hurry.is_set():
            # NOTE: everything started here is stopped; what is left is the interpreter's own
            # shutdown, where gRPC's core alone can take seconds: a second Ctrl-C skips it.
            sys.stderr.flush()
            os._exit(0)
    return 0
