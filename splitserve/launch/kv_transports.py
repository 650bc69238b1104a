"""Which KV transports a worker starts (`--kv-transport`), and how it says so.

`auto` starts every transport that works here, fastest first, and skips (with a warning that
says why) one that fails to start; naming one transport starts only that one and fails the
worker if it can't. A decode worker offers what it started in its reservations and the
registry; a prefill worker uses, per decode worker, the first transport both have.
"""

from __future__ import annotations

import logging

from opentelemetry import trace

from splitserve.engine.kv_connector import KVConnector
from splitserve.kv_transfer.registry import Registry
from splitserve.kv_transfer.transport import (
    PREFERENCE,
    KVReceiver,
    KVSender,
    Landing,
    PushObserver,
    ReceiverBind,
    transport_kind,
)
from splitserve.prefill_service.observed_transport import ObservedSender
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing

log = logging.getLogger(__name__)


def _names(choice: str) -> tuple[str, ...]:
    if choice == "auto":
        return PREFERENCE
    if choice not in PREFERENCE:
        raise ValueError(f"--kv-transport {choice!r}: choose auto or one of {list(PREFERENCE)}")
    return (choice,)


def start_receivers(
    choice: str,
    connector: KVConnector,
    landing: Landing,
    worker_id: str,
    tracer: trace.Tracer | None = None,
    on_push: PushObserver | None = None,
    bind: ReceiverBind | None = None,
) -> tuple[list[KVReceiver], tuple[str, ...]]:
    """The receivers started and the names offered, fastest first. `bind` is where a receiver
    with a socket of its own (gRPC) listens."""
    receivers: list[KVReceiver] = []
    offered: list[str] = []
    for name in _names(choice):
        kind = transport_kind(name)
        try:
            receivers.append(kind.receiver(connector, landing, worker_id, tracer, on_push, bind))
        except Exception as exc:
            if choice != "auto":
                raise RuntimeError(f"KV transport {name} could not start: {exc}") from exc
            log.warning("KV transport %s could not start (%s); not offering it", name, exc)
            continue
        offered.append(name)
    log.warning("%s receives KV with %s", worker_id, ", ".join(offered))
    return receivers, tuple(offered)


def start_senders(
    choice: str, connector: KVConnector, worker_id: str, cluster_secret: str = ""
) -> dict[str, KVSender]:
    """This worker's senders by name, fastest first; pushes carry `cluster_secret` (if any)."""
    senders: dict[str, KVSender] = {}
    for name in _names(choice):
        try:
            senders[name] = transport_kind(name).sender(connector, worker_id, cluster_secret)
        except Exception as exc:
            if choice != "auto":
                raise RuntimeError(f"KV transport {name} could not start: {exc}") from exc
            log.warning("KV transport %s could not start (%s); not using it", name, exc)
    log.warning("%s sends KV with %s", worker_id, ", ".join(senders))
    return senders


def start_core_receivers(
    service: ServiceSettings,
    worker: WorkerSettings,
    connector: KVConnector,
    landing: Landing,
    cluster_secret: str,
    tracing: Tracing,
    on_push: PushObserver,
) -> tuple[list[KVReceiver], tuple[str, ...]]:
    """An engine core's receivers (`start_receivers`), listening where the worker's settings
    say and vetting NIXL senders by what the cluster's members published."""
    # NOTE: the receivers vet NIXL senders by what members published: a registry read on a new
    # sender's first push, not on the token path.
    registry = Registry(service.redis_url, retry_s=service.registry_retry_s, secret=cluster_secret)
    return start_receivers(
        worker.kv_transport,
        connector,
        landing,
        service.worker_id,
        tracing.tracer if tracing.enabled else None,
        on_push,
        ReceiverBind(
            service.host,
            worker.kv_port,
            service.public_host,
            cluster_secret,
            vouch=registry.kv_endpoint_values,
        ),
    )


def start_core_senders(
    service: ServiceSettings,
    worker: WorkerSettings,
    connector: KVConnector,
    cluster_secret: str,
    tracing: Tracing,
    on_push: PushObserver,
) -> dict[str, KVSender]:
    """An engine core's senders (`start_senders`), each push traced and reported to the front
    (`on_push`: the transfer metrics live there)."""
    return {
        name: ObservedSender(sender, tracing, on_push)
        for name, sender in start_senders(
            worker.kv_transport, connector, service.worker_id, cluster_secret
        ).items()
    }
