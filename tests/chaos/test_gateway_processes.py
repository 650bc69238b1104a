"""`splitserve gateway --processes 2` under a supervising parent, broken on purpose: a process
killed with SIGKILL is restarted and the port keeps serving; a second gateway on the same port
is refused at start; SIGTERM stops the whole group; each process serves /metrics on a port of
its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.launch.ports import new_ports
from splitserve.launch.up import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _until(check, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_a_killed_gateway_process_is_restarted_and_sigterm_stops_the_group(
    tiny_models, redis_server
):
    port = free_port("127.0.0.1")
    # NOTE: two consecutive free ports: process i serves /metrics on metrics + i
    metrics = new_ports("127.0.0.1", {port}, 2)
    cmd = [sys.executable, "-m", "splitserve.cli", "gateway", "--model", str(tiny_models["llama"]),
           "--redis-url", redis_server.url, "--port", str(port), "--processes", "2",
           "--metrics-port", str(metrics), "--drain-timeout-s", "2"]  # fmt: skip
    parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        for line in parent.stdout:
            if "with 2 processes" in line:
                break
        threading.Thread(target=parent.stdout.read, daemon=True).start()  # keep the pipe open
        address = f"127.0.0.1:{port}"
        assert _serving(address)
        first = _children(parent.pid)
        assert len(first) == 2
        for i in range(2):  # one /metrics port per process
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics + i}/metrics", timeout=10) as r:
                assert b"splitserve" in r.read()

        # A second gateway group on the same port is refused before it starts anything.
        second = subprocess.run(
            [*cmd[:-6], "--processes", "2"], capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 2 and "in use" in second.stderr, second.stderr

        os.kill(first[0], signal.SIGKILL)
        _until(lambda: len(_children(parent.pid)) == 2 and first[0] not in _children(parent.pid))
        _until(lambda: _serving(address))
        assert parent.poll() is None

        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 0
        assert not _alive(first[1]), "a gateway process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
