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
from splitserve.kv_transfer.transport import (
    PREFERENCE,
    KVReceiver,
    KVSender,
    Landing,
    PushObserver,
    ReceiverBind,
    transport_kind,
)

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
