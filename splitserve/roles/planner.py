"""`splitserve planner`: a small service of its own that holds the P:D split to an SLO by moving
`--role-switch` workers between prefill and decode.

Every `--interval-s` it takes one snapshot of what is already published (`Signals`):

    registry            live workers by kind; each decode worker's free and total blocks
    gateway ledgers     prompt tokens in flight per prefill worker ({ns}:gw:prefill:{id})
    gateways' /metrics  splitserve:time_to_first_token_seconds and
                        splitserve:inter_token_latency_seconds histograms (p90 of the window)

asks `planner_policy.decide`, and makes the move it names with `WorkerRole.SetRole` on the
least-loaded worker of the side that gives one up. Why a service and not a gateway option: the
gateway runs as many processes and replicas as the load needs, and a split must be decided
once; a service of its own is one Deployment with one replica on Kubernetes (docs/deploy.md),
and it can be stopped without touching the request path.

With `--log-json PATH` it appends one JSON line per snapshot (signals, decision, split): the
split over time.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from splitserve.roles.control import set_role
from splitserve.roles.planner_policy import Decision, PlannerConfig, Signals, decide

log = logging.getLogger(__name__)

TTFT = "splitserve:time_to_first_token_seconds"
ITL = "splitserve:inter_token_latency_seconds"


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The `q` quantile of a histogram given as (upper bound, cumulative count) pairs sorted by
    bound (linear within the bucket, as Prometheus' histogram_quantile); None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            span = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / span if span else 1)
        prev_bound, prev_count = bound, count
    return prev_bound


class HistogramWindow:
    """The quantile of a cumulative histogram, summed over several /metrics pages, over what
    was observed since the previous read."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._last: dict[float, float] = {}

    def read(self, pages: Sequence[str], q: float = 0.9) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        now: dict[float, float] = {}
        for page in pages:
            for family in text_string_to_metric_families(page):
                if family.name != self.name:
                    continue
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        le = float(sample.labels["le"])
                        now[le] = now.get(le, 0.0) + sample.value
        delta = sorted((le, count - self._last.get(le, 0.0)) for le, count in now.items())
        self._last = now
        return bucket_quantile(delta, q)


def _fetch(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 - operator's URL
        return reply.read().decode()


class SignalSource:
    """Reads one `Signals` snapshot from the registry, the gateways' ledgers and /metrics."""

    def __init__(
        self,
        redis_url: str,
        metrics_urls: Sequence[str],
        cluster_secret: str = "",
        namespace: str = "splitserve",
        fetch: Callable[[str], str] = _fetch,
    ) -> None:
        import redis

        from splitserve.kv_transfer.registry import Registry

        self.registry = Registry(redis_url, namespace=namespace, secret=cluster_secret)
        self._redis = redis.Redis.from_url(redis_url)
        self._ns = namespace
        self.metrics_urls = list(metrics_urls)
        self._fetch = fetch
        self._ttft, self._itl = HistogramWindow(TTFT), HistogramWindow(ITL)
        self.workers: dict[str, list[Any]] = {}

    def read(self) -> Signals:
        self.workers = {k: self.registry.live_workers(k) for k in ("prefill", "decode")}
        prefill, decode = self.workers["prefill"], self.workers["decode"]
        queued = 0
        for w in prefill:
            queued += sum(int(v) for v in self._redis.hvals(f"{self._ns}:gw:prefill:{w.worker_id}"))
        usage = max(
            (1 - w.num_free_blocks / w.num_total_blocks for w in decode if w.num_total_blocks),
            default=0.0,
        )
        pages = []
        for url in self.metrics_urls:
            try:
                pages.append(self._fetch(url))
            except OSError as exc:
                log.warning("could not read %s: %s", url, exc)
        return Signals(
            at_s=time.monotonic(),
            num_prefill=len(prefill),
            num_decode=len(decode),
            ttft_p90_s=self._ttft.read(pages),
            tpot_p90_s=self._itl.read(pages),
            prefill_queued_tokens=queued,
            decode_kv_usage=usage,
        )

    def close(self) -> None:
        self.registry.close()
        self._redis.close()


class Planner:
    """The loop: snapshot, decide, move (one worker at a time), log."""

    def __init__(
        self,
        source: SignalSource,
        config: PlannerConfig,
        cluster_secret: str = "",
        drain_timeout_s: float = 0.0,
        dry_run: bool = False,
        log_json: str = "",
    ) -> None:
        self.source, self.config = source, config
        self.cluster_secret, self.drain_timeout_s = cluster_secret, drain_timeout_s
        self.dry_run, self.log_json = dry_run, log_json
        self.last_move_at_s: float | None = None

    def step(self) -> Decision:
        signals = self.source.read()
        decision = decide(signals, self.config, self.last_move_at_s)
        moved = ""
        if decision.move is not None and not self.dry_run:
            moved = self._move(decision.move)
            self.last_move_at_s = time.monotonic()
        if decision.move is not None:
            log.warning("planner: %s (%s) %s", decision.move, decision.reason, moved)
        if self.log_json:
            line = {"time": time.time(), **asdict(signals), **asdict(decision), "worker": moved}
            with open(self.log_json, "a") as out:
                out.write(json.dumps(line) + "\n")
        return decision

    def _move(self, move: str) -> str:
        side, to = ("decode", "prefill") if move == "to_prefill" else ("prefill", "decode")
        worker = min(self.source.workers[side], key=lambda w: (w.load, w.worker_id))
        set_role(worker.address, worker.worker_id, to, self.cluster_secret, self.drain_timeout_s)
        return worker.worker_id

    def run(self, interval_s: float, stop: threading.Event) -> None:
        while not stop.wait(interval_s):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a failed snapshot or move is tried next turn
                log.exception("planner step failed")


def add_planner_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttft-slo-s", type=float, required=True, help="the TTFT target (p90)")
    p.add_argument("--tpot-slo-s", type=float, required=True, help="the TPOT target (p90)")
    p.add_argument(
        "--gateway-metrics",
        action="append",
        default=[],
        help="a gateway process's /metrics URL (repeat for each; TTFT and TPOT come from them)",
    )
    p.add_argument("--interval-s", type=float, default=2.0, help="seconds between snapshots")
    p.add_argument("--min-dwell-s", type=float, default=30.0, help="no move sooner after one")
    p.add_argument("--kv-usage-high", type=float, default=0.9, help="decode KV use that is full")
    p.add_argument(
        "--queued-tokens-high",
        type=int,
        default=16384,
        help="prompt tokens in flight per prefill worker that count as full",
    )
    p.add_argument(
        "--drain-timeout-s", type=float, default=0.0, help="a switch's drain (0: the worker's)"
    )
    p.add_argument("--dry-run", action="store_true", help="decide and log, move nothing")
    p.add_argument("--log-json", default="", help="append each snapshot and decision here")


def run_planner(args: argparse.Namespace, redis_url: str, cluster_secret: str) -> int:
    """`splitserve planner` until SIGTERM or Ctrl-C."""
    import signal

    config = PlannerConfig(
        args.ttft_slo_s,
        args.tpot_slo_s,
        min_dwell_s=args.min_dwell_s,
        kv_usage_high=args.kv_usage_high,
        queued_tokens_high=args.queued_tokens_high,
    )
    if not args.interval_s > 0:
        raise ValueError(f"--interval-s must be > 0, got {args.interval_s}")
    source = SignalSource(redis_url, args.gateway_metrics, cluster_secret)
    planner = Planner(
        source, config, cluster_secret, args.drain_timeout_s, args.dry_run, args.log_json
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"planner holding TTFT <= {config.ttft_slo_s} s, TPOT <= {config.tpot_slo_s} s", flush=True
    )
    try:
        planner.run(args.interval_s, stop)
    finally:
        source.close()
    return 0
