"""What every worker that serves decode shares at its start (`services.py`'s decode and
colocated workers, `splitserve/roles/switchable.py`'s `--role-switch` ones): its decode side,
built on the loaded core by `start_decode_worker` — the `DecodeWorker` and its servicer, a
heartbeat that expires its reservations and republishes its prefix index, and a stop and drain
that wait for its reservations and streams — so both kinds keep them the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from splitserve.decode_service.observer import DecodeObserver
from splitserve.decode_service.reservations import ReservationBook
from splitserve.decode_service.servicer import DecodeServicer
from splitserve.decode_service.worker import DecodeSettings, DecodeWorker
from splitserve.kv_transfer.presence import Presence
from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.launch.engine_core import run_core
from splitserve.launch.worker_record import worker_info
from splitserve.launch.worker_start import Loaded, Served, start_worker
from splitserve.runtime.engine_core.client import CoreTarget
from splitserve.runtime.engine_core.protocol import endpoint_from_wire
from splitserve.runtime.metrics import Metrics, RequestMetrics
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Running, ServiceSpec
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing

P = TypeVar("P", bound=Presence)


def decode_worker(loaded: Loaded, service: ServiceSettings, worker: WorkerSettings) -> DecodeWorker:
    """The decode side of a worker: reserves blocks for prefill workers' pushes and streams
    what its engine core decodes."""
    return DecodeWorker(
        loaded.core,
        loaded.registry,
        DecodeSettings(
            service.worker_id,
            loaded.opened.address,
            lease_s=worker.lease_s,
            kv_transports=tuple(loaded.limits["kv_transports"]),
            stream_interval=worker.stream_interval,
        ),
        ReservationBook(per_caller=worker.max_reservations_per_caller),
    )


def decode_servicer(decode: DecodeWorker, tracing: Tracing, metrics: Metrics) -> DecodeServicer:
    """The `DecodeWorker` service in front of `decode`, measuring what it streams."""
    requests = RequestMetrics(
        metrics, ("inter_token_latency", "e2e_request_latency"), outcomes=True
    )
    return DecodeServicer(decode, DecodeObserver(tracing, requests, metrics.model_name))


def _decode_presence(
    presence: Callable[..., P],
    loaded: Loaded,
    info: Callable[[], WorkerInfo],
    worker: WorkerSettings,
    decode: DecodeWorker,
) -> P:
    """A decode worker's heartbeat (`presence`: its maker), not yet started: its housekeeping
    (expired reservations) on each tick and its prefix index published again on a rejoin."""
    return presence(
        loaded.registry,
        info,
        ttl_s=worker.heartbeat_ttl_s,
        interval_s=worker.heartbeat_ttl_s / 6,
        on_tick=decode.housekeeping,
        kv_endpoint=endpoint_from_wire(loaded.limits["kv_endpoint"]),
        on_rejoin=decode.prefix.republish,
    )


def _serving_decode(
    worker: object,
    presence: Presence,
    decode: DecodeWorker,
    close: tuple[Callable[[], None], ...] = (),
) -> Served:
    """A worker that serves decode: it leaves the prefix index before its server stops, and
    a drain waits for its open reservations and its streams."""
    # NOTE: a reservation waits for its Decode call; draining must not end in between. Streams
    # on a DecodeMany call are counted here, not as calls (`lifecycle.CARRIERS`).
    return Served(
        worker,
        presence,
        leave=(decode.prefix.leave,),
        close=close,
        pending=lambda: decode.num_in_flight,
    )


@dataclass(frozen=True)
class DecodeWired:
    """What a worker that serves decode built around its decode side (`start_decode_worker`'s
    `wire`): `worker` (`Running.worker`), what the registry lists it as now (`kind`) and the
    KV transports it offers (`transports`), the maker of its heartbeat (`Presence`'s
    signature), and what its stop adds once the server stopped (servicers' threads)."""

    worker: object
    kind: Callable[[], str]
    transports: Callable[[], tuple[str, ...]]
    presence: Callable[..., Presence] = Presence
    close: tuple[Callable[[], None], ...] = ()


def start_decode_worker(
    service: ServiceSettings,
    worker: WorkerSettings,
    role: str,
    specs: Sequence[ServiceSpec],
    wire: Callable[[Loaded, DecodeWorker, DecodeServicer], DecodeWired],
    *,
    tracing: Tracing,
    security: Security,
    on_core_death: Callable[[BaseException], None] | None,
    core_entry: CoreTarget = run_core,
) -> Running:
    """A worker that serves decode (`start_worker`; the front detokenizes its streams): its
    decode side built on the loaded core (`decode_worker`, and the `DecodeWorker` servicer in
    front of it, which `wire` binds with the rest of its role), a heartbeat that expires its
    reservations and republishes its prefix index, and a stop and drain that wait for its
    reservations and streams."""

    def wire_decode(loaded: Loaded) -> Served:
        decode = decode_worker(loaded, service, worker)
        wired = wire(loaded, decode, decode_servicer(decode, tracing, loaded.opened.metrics))

        def info() -> WorkerInfo:
            return worker_info(
                wired.kind(),
                service.worker_id,
                loaded.opened.address,
                loaded.watch,
                wired.transports(),
                loaded.limits,
            )

        presence = _decode_presence(wired.presence, loaded, info, worker, decode)
        return _serving_decode(wired.worker, presence, decode, close=wired.close)

    return start_worker(
        service,
        worker,
        role,
        specs,
        wire_decode,
        tracing=tracing,
        security=security,
        detokenizes=True,
        on_core_death=on_core_death,
        core_entry=core_entry,
    )
