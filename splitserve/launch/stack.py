"""A running `splitserve up` stack: its service processes, its Redis and secrets, and how it
stops (the gateway drains first, then the workers; a second Ctrl-C cuts the drains short)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import cast

from splitserve.runtime.redis_keeper import RedisKeeper
from splitserve.runtime.stack_secrets import StackSecrets

HURRY_S = 0.5  # after a second Ctrl-C: how long services get to exit before they are killed


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
    gateway_processes: int = 1  # the gateway's processes; process i's /metrics: port + i
    http_url: str | None = None  # the OpenAI-compatible API's base URL, e.g. http://host:port/v1
    stop_timeout_s: float = 35.0
    secrets: StackSecrets | None = None  # the services' shared secrets (files of its own)

    def process(self, name: str) -> subprocess.Popen:
        """The process of service `name` ("gateway", "decode-0", "prefill-1", …)."""
        return next(p for p in self.processes if service_id(p) == name)

    def stop(self, timeout_s: float | None = None, hurry: threading.Event | None = None) -> None:
        """SIGTERM the gateway and wait for it to drain, then the workers; kill what is still
        running after `timeout_s`. Once `hurry` is set, every service gets a second SIGTERM
        (which cuts its drain short) and `HURRY_S` to exit before it is killed."""
        deadline = time.monotonic() + (timeout_s or self.stop_timeout_s)
        hurry = hurry or threading.Event()
        gateways = [p for p in self.processes if service_name(p) == "gateway"]
        workers = [p for p in self.processes if service_name(p) != "gateway"]
        for group in (gateways, workers):
            _signal(group)
            _wait(group, deadline, hurry)
            if hurry.is_set():
                break
            _kill(group)
        if hurry.is_set():
            _signal(workers)  # NOTE: a first signal for any not yet stopping, so that …
            time.sleep(0.1)
            _signal(self.processes)  # … this second one cuts every drain short
            if self.redis is not None:
                self.redis.terminate()  # NOTE: meanwhile, not after
            _wait(self.processes, time.monotonic() + HURRY_S, threading.Event())
            _kill(self.processes)
        if self.redis is not None:
            self.redis.stop(0.5 if hurry.is_set() else 10.0)
        if self.secrets is not None:
            self.secrets.close()


def _signal(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def _wait(procs: list[subprocess.Popen], deadline: float, hurry: threading.Event) -> None:
    """Until every process has exited, `deadline` passed or `hurry` is set."""
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if hurry.wait(0.05):
            return


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def service_name(proc: subprocess.Popen) -> str:
    """The service a child runs: `python -m splitserve.cli <service> …`."""
    return str(cast(list[str], proc.args)[3])


def service_id(proc: subprocess.Popen) -> str:
    """The name a child serves under: its worker id ("decode-0", …), or "gateway"."""
    args = cast(list[str], proc.args)
    return args[args.index("--worker-id") + 1] if "--worker-id" in args else service_name(proc)
