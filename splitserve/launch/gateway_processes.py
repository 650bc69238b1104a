"""`splitserve gateway --processes N`: N gateway processes serving one gRPC port (and one HTTP
port), with a parent that supervises them.

    splitserve gateway --processes 3 --port 50051
      └─ parent: checks the ports are free, holds them (SO_REUSEPORT, not listening), then
         ├─ gateway process 0 ─┐  each: the whole gateway (gRPC + HTTP, routing, streams),
         ├─ gateway process 1 ─┼─ listening on the same ports with SO_REUSEPORT: the kernel
         └─ gateway process 2 ─┘  spreads new connections over them

A port that another program (or another gateway) holds is still an error at start: the parent
first binds each port *without* SO_REUSEPORT, which fails if anyone holds it, then keeps a
SO_REUSEPORT socket bound (never listening: it takes no connections) so that no later gateway
can pass that check while this one runs. Only processes of this group set SO_REUSEPORT.

What the processes must agree on is in Redis, as for N replicas behind a Kubernetes Service
(gateway/replicas.py): who owns each request id (Abort and duplicate ids work from any process)
and each prefill worker's prompt tokens in flight. Each process has its own `--max-inflight`
share: ceil(max_inflight / N). Each serves /metrics on `--metrics-port` + its index.

Supervision: a process that exits during start-up takes the group down (its error is printed:
a bad flag or model is the same for all). One that dies later is restarted (its streams are
lost; the other processes' go on), unless `MAX_RESTARTS` happened within `RESTART_WINDOW_S`:
then the group stops, exit code 1. SIGTERM (or Ctrl-C) is passed to every process, which
drains; a second one cuts the drains short. A process whose parent goes away stops (its stdin
closes).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.runtime.grpc_server import BindError

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
MAX_DEFAULT_PROCESSES = 8


def default_processes(cores: int | None = None) -> int:
    """`--processes 0`: a quarter of the cores this process may use (its CPU affinity and
    cgroup quota), 1 to 8: the rest of the host's cores are the workers' (docs/deploy.md)."""
    if cores is None:
        cores = usable_cores()
    return max(1, min(MAX_DEFAULT_PROCESSES, cores // 4))


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores or 1, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores or 1


def inflight_share(max_inflight: int, processes: int) -> int:
    """One process's share of the group's --max-inflight."""
    return max(1, math.ceil(max_inflight / processes))


def hold_port(host: str, port: int, flag: str) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT (not listening), after checking that
    nobody holds the port; BindError if someone does. Port 0: a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port:
        with socket.socket(family) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise BindError(
                    f"{flag}: cannot listen on {host}:{port}: {exc.strerror or exc} (another "
                    "server on this port?)"
                ) from None
    held = socket.socket(family)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind((host, port))
    except OSError as exc:
        held.close()
        raise BindError(f"{flag}: cannot listen on {host}:{port}: {exc}") from None
    return held


@dataclass
class _Child:
    index: int
    argv: list[str]
    proc: subprocess.Popen[str] | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    signalled: bool = False

    def start(self) -> None:
        self.ready.clear()
        self.signalled = False
        # NOTE: a session of its own: a Ctrl-C at the terminal reaches the parent only, which
        # passes one SIGTERM to each (a second would cut their drains short).
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._relay, args=(self.proc,), daemon=True).start()

    def _relay(self, proc: subprocess.Popen[str]) -> None:
        """Print the process's output as ours; note when it says it serves."""
        assert proc.stdout is not None
        for line in proc.stdout:
            if " serving on " in line:
                self.ready.set()
            print(line, end="", flush=True)

    def terminate(self, again: bool = False) -> None:
        """SIGTERM (it drains) once; `again`: a second one (it cuts the drain short)."""
        if self.signalled and not again:
            return
        self.signalled = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def run_gateway_processes(
    argv: Sequence[str], processes: int, host: str, port: int, http_port: int,
    metrics_port: int, worker_id: str, max_inflight: int, drain_timeout_s: float,
    metrics_host: str = "",
) -> int:  # fmt: skip
    """Run `processes` gateways (the `splitserve gateway` command line `argv`, each told its
    ports, id and share) until SIGTERM; see the module doc. The exit code. `metrics_host`:
    where their /metrics ports are (default `host`)."""
    held = [hold_port(host, port, "--port")]
    if http_port:
        held.append(hold_port(host, http_port, "--http-port"))
    port = held[0].getsockname()[1]
    if len(held) > 1:
        http_port = held[1].getsockname()[1]
    for i in range(processes if metrics_port else 0):  # NOTE: a clear error before any starts
        where = metrics_host or host
        hold_port(where, metrics_port + i, f"--metrics-port (+{i}, process {i}'s /metrics)").close()
    share = inflight_share(max_inflight, processes)
    children = []
    for i in range(processes):
        extra = [
            "--processes", "1", "--reuse-port", "--port", str(port),
            "--worker-id", f"{worker_id}-p{i}", "--max-inflight", str(share),
        ]  # fmt: skip
        if len(held) > 1:
            extra += ["--http-port", str(http_port)]
        if metrics_port:
            extra += ["--metrics-port", str(metrics_port + i)]
        children.append(_Child(i, [sys.executable, "-m", "splitserve.cli", *argv, *extra]))
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        again = stop.is_set()
        (hurry if again else stop).set()
        for child in children:
            child.terminate(again)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        return _supervise(children, stop, hurry, port, drain_timeout_s)
    finally:
        for sock in held:
            sock.close()


def _supervise(
    children: list[_Child],
    stop: threading.Event,
    hurry: threading.Event,
    port: int,
    drain_timeout_s: float,
) -> int:
    for child in children:
        child.start()
    # Start-up: every process serving, or the group goes down with the first one's exit code.
    while not all(c.ready.is_set() for c in children):
        dead = [c for c in children if c.proc is not None and c.proc.poll() is not None]
        if dead or stop.is_set():
            _stop_all(children, drain_timeout_s, hurry)
            return dead[0].proc.returncode if dead and dead[0].proc else 130
        time.sleep(0.1)
    print(f"gateway serving on port {port} with {len(children)} processes", flush=True)
    restarts: list[float] = []
    while not stop.wait(0.5):
        for child in children:
            assert child.proc is not None
            if child.proc.poll() is None:
                continue
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
            if len(restarts) >= MAX_RESTARTS:
                print(
                    f"gateway process {child.index} exited ({child.proc.returncode}); "
                    f"{MAX_RESTARTS} restarts within {RESTART_WINDOW_S:.0f} s: stopping all",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                _stop_all(children, drain_timeout_s, hurry)
                return 1
            print(
                f"gateway process {child.index} exited ({child.proc.returncode}); restarting it",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            restarts.append(now)
            child.start()
    _stop_all(children, drain_timeout_s, hurry)
    return 0


def _stop_all(children: list[_Child], drain_timeout_s: float, hurry: threading.Event) -> None:
    """SIGTERM each (if not yet) and wait for their drains; kill what is left after
    `drain_timeout_s` + 10 s, or soon after a second signal."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + drain_timeout_s + 10.0
    for child in children:
        assert child.proc is not None
        while child.proc.poll() is None and time.monotonic() < deadline:
            if hurry.is_set():
                deadline = min(deadline, time.monotonic() + 2.0)
            time.sleep(0.05)
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
