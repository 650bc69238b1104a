"""Helpers for end-to-end tests: a real stack (redis-server, worker and gateway processes on
loopback), its workers' stats and metrics, and the leak check every test ends with."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from splitserve.kv_transfer.cluster import secret_metadata
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.launch.up import Stack, StackSettings, start_stack
from splitserve.protos.v1 import gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

# Short leases and heartbeats so that failure tests finish quickly.
WORKER_ARGS = (
    "--lease-s",
    "3",
    "--heartbeat-ttl-s",
    "1.5",
    "--num-kv-blocks",
    "400",
    "--max-num-batched-tokens",
    "128",
)


@contextmanager
def running_stack(
    model_dir: str,
    prefill: int,
    decode: int,
    kv_transport: str = "auto",
    worker_args: tuple[str, ...] = (),
    **settings: Any,
) -> Iterator[Stack]:
    """A ready stack; `worker_args` go to every worker after `WORKER_ARGS` (so they win);
    `settings` are more `StackSettings` fields (metrics, env, …)."""
    stack = start_stack(
        StackSettings(
            model=str(model_dir),
            prefill=prefill,
            decode=decode,
            extra_worker_args=(*WORKER_ARGS, "--kv-transport", kv_transport, *worker_args),
            **settings,
        )
    )
    try:
        yield stack
    finally:
        stack.stop()


def gateway(stack: Stack) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.address))


def workers(stack: Stack) -> list[WorkerInfo]:
    registry = Registry(stack.redis_url)
    try:
        return [
            w for kind in ("prefill", "decode", "colocated") for w in registry.live_workers(kind)
        ]
    finally:
        registry.close()


def stats(worker: WorkerInfo, stack: Stack | None = None) -> worker_pb2.WorkerStats:
    """The worker's stats (asked as a member of `stack`: with its cluster secret, if any)."""
    with grpc.insecure_channel(worker.address) as channel:
        if worker.kind == "prefill":
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        else:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        return stub.GetStats(
            worker_pb2.GetStatsRequest(), timeout=10, metadata=member_metadata(stack)
        )


def metric(stack: Stack, service: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (with these labels) on one service's /metrics (a stack
    started with `metrics=True`)."""
    url = f"http://127.0.0.1:{stack.metrics_ports[service]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def member_metadata(stack: Stack | None) -> tuple[tuple[str, str], ...]:
    """What a member of `stack` sends on internal calls (nothing when it has no secret)."""
    secrets = stack.secrets if stack is not None else None
    return secret_metadata(secrets.cluster_secret if secrets is not None else "")


def leftovers(stack: Stack) -> list[str]:
    """What is still held anywhere: blocks in use, requests known, reservations, Redis records,
    prefix-index entries of workers that are gone."""
    problems = []
    live = workers(stack)
    for w in live:
        s = stats(w, stack)
        if s.num_free_blocks != s.num_total_blocks:
            problems.append(f"{w.worker_id}: {s.num_total_blocks - s.num_free_blocks} blocks held")
        if s.num_requests or s.num_reservations:
            problems.append(
                f"{w.worker_id}: {s.num_requests} requests, {s.num_reservations} reservations"
            )
    registry = Registry(stack.redis_url)
    try:
        for key in registry.request_record_keys():
            # NOTE: what it says (state, owner, writer, fence, lease left) tells who left it
            record = registry.get_record(key.rsplit(":req:", 1)[1])
            problems.append(f"redis: {key} {record}")
        gone = registry.prefix_index_workers() - {w.worker_id for w in live}
        problems += [f"redis: prefix index of gone worker {worker_id}" for worker_id in gone]
    finally:
        registry.close()
    return problems


def assert_nothing_leaks(stack: Stack, timeout_s: float = 10.0) -> None:
    """Every worker's free blocks back to its total, no request anywhere, Redis clean."""
    deadline = time.monotonic() + timeout_s
    problems = leftovers(stack)
    while problems and time.monotonic() < deadline:
        time.sleep(0.2)
        problems = leftovers(stack)
    assert not problems, problems
