"""A benchmark row in a process of its own (bench/tensor_parallel_row.py), with a time limit.

The row runs in a process group of its own, so that killing it also kills the follower ranks its
engine started; its lines are echoed as they come, and the `@@ {json}` lines it writes to a pipe of
their own are its measurements, kept even if the row is killed later. Nothing a row leaves behind
(GPU memory, NCCL state, a hung collective) reaches the next one.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.tensor_parallel_row import RESULT_FD_ENV, RESULT_PREFIX

ROOT = Path(__file__).resolve().parents[1]
# NOTE: NVLink multicast (NVLS) stays off on a shared host: a program that uses it can put the
# host's GPUs out of service. Every process this benchmark starts inherits these.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_STOP_GRACE_S = 30.0  # a row that measured everything gets this long to stop its engine


def child_env() -> dict[str, str]:
    """This process's environment, NVLink multicast off, the repository importable."""
    env = dict(os.environ)
    for key, value in NO_MULTICAST.items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (zombies don't count: a follower
    whose parent died waits for init to reap it, and holds no GPU memory)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a row's process group (its engine and the engine's follower ranks), reap it,
    and wait until no process of it runs, so that the next row finds the GPUs' memory free."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def run_row(spec: dict, timeout_s: float) -> dict:
    """One configuration in a process of its own (bench/tensor_parallel_row.py), its lines
    echoed as they come: what it measured, plus `error` if it failed or ran out of time."""
    row: dict[str, Any] = {"config": spec["name"], "tp": spec["tp"]}
    cmd = [sys.executable, "-m", "bench.tensor_parallel_row", json.dumps(spec)]
    # NOTE: measurements come on a pipe of their own: the row's follower ranks share its
    # stdout and stderr, and a line of theirs once landed inside a measurement line.
    results_r, results_w = os.pipe()
    env = child_env()
    env[RESULT_FD_ENV] = str(results_w)
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=(results_w,),
            start_new_session=True,  # NOTE: its own process group, followers included
        )
    finally:
        os.close(results_w)
    tail: collections.deque[str] = collections.deque(maxlen=12)

    def echo() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"    {line}", end="", flush=True)
            tail.append(line.rstrip())

    def results() -> None:
        with os.fdopen(results_r, encoding="utf-8") as lines:
            for line in lines:
                if line.startswith(RESULT_PREFIX):
                    row.update(json.loads(line[len(RESULT_PREFIX) :]))

    readers = [threading.Thread(target=f, daemon=True) for f in (echo, results)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if row.get("complete"):
            deadline = min(deadline, time.monotonic() + _STOP_GRACE_S)
        time.sleep(0.2)
    code = proc.poll()
    _kill_group(proc)
    for reader in readers:
        reader.join(5)
    last = tail[-1] if tail else "(no output)"
    if code is None and row.pop("complete", False):
        row["stop_error"] = f"measured, but did not stop within {_STOP_GRACE_S:.0f} s"
    elif code is None:
        row["error"] = f"timed out after {timeout_s:.0f} s; its last line: {last}"
    elif code != 0:
        row["error"] = f"exit code {code}: " + " | ".join(tail)[-600:]
    row.pop("complete", None)
    return row
