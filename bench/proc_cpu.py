"""CPU time of a stack's processes, read from /proc: which process limits a benchmark.

`CPUMeter(named)` takes `{name: pid}`; each process's children (a worker's engine core, a
gateway's replicas) are found at every reading and counted under `name/child-pid`, so the
cores each process used over a window come out per process, front and core apart.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` (all its threads), or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def children(pid: int) -> list[int]:
    """Direct children of `pid`, whichever of its threads started them."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return kids


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def tree(named: dict[str, int]) -> dict[str, int]:
    """`named` plus every descendant as `name/<pid>` (helper processes such as
    multiprocessing's resource tracker left out)."""
    out: dict[str, int] = {}

    def walk(name: str, pid: int) -> None:
        out[name] = pid
        for kid in children(pid):
            if "resource_tracker" not in _command(kid):
                walk(f"{name}/{kid}", kid)

    for name, pid in named.items():
        walk(name, pid)
    return out


class CPUMeter:
    """Cores each process used between `start()` and `stop()`."""

    def __init__(self, named: dict[str, int]) -> None:
        self.named = named
        self._t0 = 0.0
        self._cpu0: dict[str, float] = {}

    def start(self) -> None:
        self._pids = tree(self.named)
        self._cpu0 = {n: c for n, pid in self._pids.items() if (c := cpu_seconds(pid)) is not None}
        self._t0 = time.monotonic()

    def stop(self) -> dict[str, float]:
        window = max(1e-9, time.monotonic() - self._t0)
        cores = {}
        for name, pid in self._pids.items():
            now = cpu_seconds(pid)
            if now is not None and name in self._cpu0:
                cores[name] = round((now - self._cpu0[name]) / window, 3)
        return cores
