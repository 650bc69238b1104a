"""`splitserve up`: Redis, prefill and decode workers and the gateway, as real processes.

Starts its own `redis-server` on a free port unless given a URL, builds the tiny default model
if none is given, waits until every worker has registered and the gateway is serving, prints
the address, and on Ctrl-C (or SIGTERM) stops everything it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_transfer.redis_server import RedisServer
from kv_transfer.registry import Registry


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
    redis: RedisServer | None = None

    def stop(self, timeout_s: float = 15.0) -> None:
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
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


def default_model_dir() -> Path:
    """Where the tiny default model is built (and reused) when no --model is given."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitserve" / "tiny-llama"


def ensure_default_model() -> str:
    from engine.tiny_model import make_tiny_model

    path = default_model_dir()
    if not (path / "config.json").is_file():
        make_tiny_model(path, "llama")
    return str(path)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def start_stack(settings: StackSettings) -> Stack:
    model = settings.model or ensure_default_model()
    redis = None
    redis_url = settings.redis_url
    if redis_url is None:
        redis = RedisServer()
        redis_url = redis.url
    port = settings.port or free_port(settings.host)
    stack = Stack(f"{settings.host}:{port}", redis_url, model, redis=redis)
    cli = [sys.executable, "-m", "splitserve.cli"]
    common = ["--model", model, "--redis-url", redis_url, "--host", settings.host]
    try:
        decode_kind = ["--colocated"] if settings.prefill == 0 else []
        for i in range(settings.decode):
            stack.processes.append(
                subprocess.Popen(
                    [
                        *cli,
                        "decode",
                        *common,
                        "--worker-id",
                        f"decode-{i}",
                        *decode_kind,
                        *settings.extra_worker_args,
                    ]
                )
            )
        for i in range(settings.prefill):
            stack.processes.append(
                subprocess.Popen(
                    [
                        *cli,
                        "prefill",
                        *common,
                        "--worker-id",
                        f"prefill-{i}",
                        *settings.extra_worker_args,
                    ]
                )
            )
        stack.processes.append(
            subprocess.Popen(
                [*cli, "gateway", *common, "--port", str(port), *settings.extra_gateway_args]
            )
        )
        _wait_ready(stack, settings)
    except BaseException:
        stack.stop()
        raise
    return stack


def _wait_ready(stack: Stack, settings: StackSettings) -> None:
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
