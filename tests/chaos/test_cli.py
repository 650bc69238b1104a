"""`splitserve up` as a user runs it, in real subprocesses on the tiny model: a second stack on a
port in use fails at start with a clear message (and so does a gRPC server binding it), a second
Ctrl-C cuts the drain short within 2 s, and Ctrl-C during start-up stops what started. Each test
ends with nothing left running (and the first stack's leak check)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.client import collect, connect, stream
from splitserve.engine import SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack

pytestmark = pytest.mark.slow

SERVING = re.compile(r"splitserve is serving on (\S+) \(model .*, redis (\S+)\)")


class Up:
    """`python -m splitserve.cli up …` in a session of its own (so that the signals sent here
    reach it alone, like a Ctrl-C at its terminal), its output read line by line."""

    def __init__(self, model: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--model", str(model), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str | re.Pattern[str], timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the output of up:\n{self.output}")

    def descendants(self) -> set[int]:
        """Every process below `up` now (its services, the Redis keeper and redis-server)."""
        found: set[int] = set()
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    children = (task / "children").read_text().split()
                except OSError:
                    continue
                for child in map(int, children):
                    if child not in found:
                        found.add(child)
                        todo.append(child)
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _assert_all_gone(pids: set[int], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids), f"left running: {_alive(pids)}"


@pytest.fixture
def up_processes() -> Iterator[list[Up]]:
    started: list[Up] = []
    yield started
    for up in started:
        up.stop()


def test_a_second_stack_on_a_port_in_use_fails_at_start(tiny_models, up_processes):
    model = tiny_models["llama"]
    with running_stack(model, prefill=1, decode=1) as stack:
        port = stack.address.rsplit(":", 1)[1]
        second = Up(model, "--port", port)
        up_processes.append(second)
        assert second.proc.wait(30) != 0
        second._reader.join(5)
        assert f"port {port} on 127.0.0.1 is in use" in second.output, second.output
        assert "Traceback" not in second.output

        # A gRPC server started on it directly (no check before) fails to bind, and says so.
        direct = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "gateway", "--model", str(model),
             "--redis-url", stack.redis_url, "--port", port],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert direct.returncode == 2, direct.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in direct.stderr
        assert "Traceback" not in direct.stderr

        # The first stack still serves everything, and holds nothing afterwards.
        done = collect(
            stream(gateway(stack), [5, 6, 7], SamplingParams(max_tokens=4), timeout_s=60)
        )
        assert done.finished is not None and len(done.token_ids[0]) == 4
        assert_nothing_leaks(stack)


def test_a_second_ctrl_c_cuts_the_drain_short_within_2_s(tiny_models, up_processes):
    up = Up(tiny_models["llama"], "--drain-timeout-s", "60")
    up_processes.append(up)
    address = up.wait_for(SERVING, 120).group(1)
    below = up.descendants()
    assert len(below) >= 4  # Redis keeper, redis-server, decode, prefill, gateway

    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    channel, stub = connect(address)
    calls = [stream(stub, list(range(3, 40)), long, timeout_s=120) for _ in range(3)]
    for call in calls:
        next(call)  # in flight: the first message is out
    up.proc.send_signal(signal.SIGINT)
    up.wait_for("stopping", 10)
    time.sleep(0.5)
    assert up.proc.poll() is None, "up stopped at once: nothing was draining"
    up.proc.send_signal(signal.SIGINT)
    cut = time.monotonic()
    code = up.proc.wait(10)
    took = time.monotonic() - cut
    channel.close()
    assert took < 2.0, f"up took {took:.2f} s to exit after the second Ctrl-C"
    assert code == 0, up.output
    _assert_all_gone(below)
    up._reader.join(5)
    assert "cut short" in up.output
    assert "Traceback" not in up.output


def test_ctrl_c_during_start_up_stops_what_started(tiny_models, up_processes):
    up = Up(tiny_models["llama"])
    up_processes.append(up)
    up.wait_for("starting splitserve", 60)
    deadline = time.monotonic() + 30
    while len(up.descendants()) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)  # Redis and every service started, none ready yet
    below = up.descendants()
    assert not any(SERVING.search(line) for line in up.lines), "ready before the Ctrl-C"
    up.proc.send_signal(signal.SIGINT)
    interrupted = time.monotonic()
    code = up.proc.wait(20)
    assert time.monotonic() - interrupted < 10
    assert code == 130, up.output
    _assert_all_gone(below)
    up._reader.join(5)
    assert "interrupted" in up.output and "Traceback" not in up.output
