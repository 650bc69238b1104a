"""Setting the P:D split of a stack of `--role-switch` workers, watching it over time, and
running `splitserve planner`'s loop beside a benchmark (`bench/serving_phased.py`)."""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SPLITS = {  # name: (prefill, decode, colocated)
    "4 colocated": (0, 0, 4),
    "1P+3D": (1, 3, 0),
    "2P+2D": (2, 2, 0),
    "3P+1D": (3, 1, 0),
}


def _workers(stack: Any) -> list[Any]:
    from splitserve.roles.control import live_workers

    return sorted(live_workers(stack.redis_url), key=lambda w: w.worker_id)


def _secret(stack: Any) -> str:
    return stack.secrets.cluster_secret if stack.secrets is not None else ""


def set_split(stack: Any, split: str, expected: int) -> None:
    """Give the workers the roles of `split` (the first ones prefill, then decode, then
    colocated, in worker-id order), and wait until the registry lists them so."""
    from splitserve.roles.control import set_role

    num_prefill, num_decode, num_colocated = SPLITS[split]
    want = ["prefill"] * num_prefill + ["decode"] * num_decode + ["colocated"] * num_colocated
    deadline = time.monotonic() + 60
    while len(workers := _workers(stack)) != expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(workers)} of {expected} workers in the registry")
        time.sleep(0.2)
    moves = [(w, k) for w, k in zip(workers, want, strict=True) if w.kind != k]
    with ThreadPoolExecutor(max(1, len(moves))) as pool:
        for f in [
            pool.submit(set_role, w.address, w.worker_id, k, _secret(stack)) for w, k in moves
        ]:
            f.result()
    while sorted(w.kind for w in _workers(stack)) != sorted(want):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not take the roles of {split}")
        time.sleep(0.1)


class SplitSampler:
    """The split over time, from the registry, every `interval_s` (a thread)."""

    def __init__(self, stack: Any, interval_s: float = 0.5) -> None:
        self.stack, self.interval_s = stack, interval_s
        self.series: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> SplitSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                kinds = [w.kind for w in _workers(self.stack)]
            except Exception:  # noqa: BLE001 - a missed sample is a gap in the series
                kinds = []
            point = {k: kinds.count(k) for k in ("prefill", "decode", "colocated")}
            if not self.series or {k: self.series[-1][k] for k in point} != point:
                self.series.append({"t_s": round(time.monotonic() - self._t0, 2), **point})
            self._stop.wait(self.interval_s)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(5)
        return self.series


class PlannerThread:
    """`splitserve planner`'s loop in this process, on the stack's registry and gateway."""

    def __init__(self, stack: Any, args: argparse.Namespace) -> None:
        from splitserve.roles.planner import Planner, SignalSource
        from splitserve.roles.planner_policy import PlannerConfig

        base = stack.metrics_ports["gateway"]
        urls = [f"http://127.0.0.1:{base + i}/metrics" for i in range(stack.gateway_processes)]
        if not urls:  # NOTE: with no latency signal the planner never moves: say so at once
            raise SystemExit("the planner has no gateway /metrics to read (start with metrics)")
        self.source = SignalSource(stack.redis_url, urls, _secret(stack))
        config = PlannerConfig(
            args.planner_ttft_slo_s, args.planner_tpot_slo_s, min_dwell_s=args.planner_dwell_s
        )
        self.planner = Planner(self.source, config, _secret(stack), args.planner_drain_s)
        self.interval_s = args.planner_interval_s
        self.moves: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> PlannerThread:
        self.source.read()  # NOTE: the histograms' window starts now
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                d = self.planner.step()
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                self.moves.append(
                    {"t_s": round(time.monotonic() - self._t0, 2), "error": repr(exc)}
                )
                continue
            if d.move is not None:
                self.moves.append({"t_s": round(time.monotonic() - self._t0, 2), "move": d.move,
                                   "reason": d.reason})  # fmt: skip
                print(f"  planner at {self.moves[-1]['t_s']:.0f} s: {d.move} ({d.reason})")

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(self.interval_s + 120)
        self.source.close()
        return self.moves
