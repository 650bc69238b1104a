"""Setting a `--role-switch` worker's role from outside: the `WorkerRole.SetRole` call (what
`splitserve role` and the planner make) and the live workers it can be made on.

Its imports load on first call, so that the command line's start stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class Switched:
    """What a worker answered to SetRole."""

    worker_id: str
    kind: str
    previous_kind: str
    seconds: float
    num_streams_moved: int


def set_role(
    address: str,
    worker_id: str,
    kind: str,
    cluster_secret: str = "",
    drain_timeout_s: float = 0.0,
    timeout_s: float = 120.0,
) -> Switched:
    """Ask the worker at `address` to serve as `kind` (waits until it does)."""
    import grpc

    from splitserve.kv_transfer.cluster import secret_metadata
    from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
    from splitserve.roles.switch import kind_from_wire, kind_to_wire

    with grpc.insecure_channel(address) as channel:
        reply = worker_pb2_grpc.WorkerRoleStub(channel).SetRole(
            worker_pb2.SetRoleRequest(kind=kind_to_wire(kind), drain_timeout_s=drain_timeout_s),
            timeout=timeout_s,
            metadata=secret_metadata(cluster_secret),
        )
    return Switched(
        worker_id,
        kind_from_wire(reply.kind),
        kind_from_wire(reply.previous_kind),
        reply.switch_seconds,
        reply.num_streams_moved,
    )


def live_workers(redis_url: str, cluster_secret: str = "") -> list[Any]:
    """Every live worker of every kind (`WorkerInfo`s), from the registry."""
    from splitserve.kv_transfer.registry import Registry

    registry = Registry(redis_url, secret=cluster_secret)
    try:
        return [w for kind in KINDS for w in registry.live_workers(kind)]
    finally:
        registry.close()
