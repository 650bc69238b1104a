"""What starting any worker shares: its gRPC server up first, its engine core loaded, the
registry, the heartbeat, what its engine core's death does, and its stop in one order.

`services.py` (decode, colocated, prefill) and `splitserve/roles/switchable.py`
(`--role-switch`) differ only in what they build on the opened server and the loaded core
(`start_worker`'s `wire`); a worker that serves decode starts through `decode_start.py`, its
prefill side is `prefill_worker`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.engine.stats import EngineStats
from splitserve.engine.tokenizer import load_tokenizer
from splitserve.kv_transfer.presence import Presence
from splitserve.kv_transfer.registry import Registry
from splitserve.launch.engine_core import CoreSpec, run_core
from splitserve.prefill_service.observer import PrefillObserver
from splitserve.prefill_service.pusher import Senders
from splitserve.prefill_service.worker import PrefillSettings, PrefillWorker
from splitserve.runtime.engine_core.client import CoreStartError, CoreTarget, EngineCoreClient
from splitserve.runtime.engine_metrics import EngineCollector
from splitserve.runtime.engine_watch import EngineWatch
from splitserve.runtime.gc_heap import settle
from splitserve.runtime.metrics import KVTransferMetrics, Metrics, RequestMetrics
from splitserve.runtime.security import Security
from splitserve.runtime.serving import Opened, Running, ServiceSpec, open_service
from splitserve.runtime.settings import ServiceSettings, WorkerSettings
from splitserve.runtime.tracing import Tracing


@dataclass(frozen=True)
class Served:
    """What a role's wiring built: `worker` (`Running.worker`), its heartbeat (not started:
    `start_worker` starts it once the worker serves), and what its stop and drain add to the
    common ones."""

    worker: object
    presence: Presence
    leave: tuple[Callable[[], None], ...] = ()  # before the server stops (the prefix index)
    close: tuple[Callable[[], None], ...] = ()  # after the server stops (servicers' threads)
    pending: Callable[[], int] | None = None  # work a drain waits for beyond calls in flight


@dataclass(frozen=True)
class Loaded:
    """What `start_worker` hands a role's wiring: the opened server, the loaded core and what
    it reported when it loaded (`limits`: its transports, KV endpoint and engine limits), the
    registry and the engine watch its heartbeat reads."""

    opened: Opened
    core: EngineCoreClient
    limits: dict[str, Any]
    registry: Registry
    watch: EngineWatch


def start_core(
    role: str,
    service: ServiceSettings,
    worker: WorkerSettings,
    tracing: Tracing,
    security: Security,
    tokenizer: object | None,
    entry: CoreTarget = run_core,
) -> EngineCoreClient:
    """The worker's engine core (`--engine-core process`: a process of its own), loaded;
    `entry` builds and serves it there (a `--role-switch` worker's is its own)."""
    spec = CoreSpec(role, service, worker, security.cluster_secret, tracing.origin)
    core = EngineCoreClient(
        entry,
        spec,
        tokenizer,  # type: ignore[arg-type]
        own_process=worker.engine_core == "process",
        name=f"{service.worker_id}-core",
    )
    try:
        return core.start()
    except CoreStartError as exc:
        if exc.kind == "ValueError":  # NOTE: bad settings stay a clear error (exit code 2)
            raise ValueError(str(exc)) from None
        raise


def when_core_dies(
    core: EngineCoreClient,
    opened: Opened,
    presence: Presence,
    on_core_death: Callable[[BaseException], None] | None,
) -> None:
    """A worker whose engine core died is dead: it leaves the registry at once and stops
    serving (its streams fail UNAVAILABLE and move), or `on_core_death` decides (the CLI
    exits the process)."""

    def died(exc: BaseException) -> None:
        if on_core_death is not None:
            on_core_death(exc)
            return
        presence.leave()
        opened.server.stop(0)

    core.on_death = died


def _stats_of(core: EngineCoreClient) -> Callable[..., EngineStats]:
    def stats(timeout_s: float = 30.0) -> EngineStats:
        return EngineStats(**core.call("stats", timeout_s=timeout_s))

    return stats


def start_worker(
    service: ServiceSettings,
    worker: WorkerSettings,
    role: str,
    specs: Sequence[ServiceSpec],
    wire: Callable[[Loaded], Served],
    *,
    tracing: Tracing,
    security: Security,
    detokenizes: bool,
    on_core_death: Callable[[BaseException], None] | None,
    core_entry: CoreTarget = run_core,
) -> Running:
    """A worker serving `specs`: its server opened (NOT_SERVING), its engine core (`role`,
    started at `core_entry`) loaded (the model's tokenizer in the front if it `detokenizes`
    streams), then `wire` builds and binds the role's parts, it turns SERVING, and then its
    heartbeat starts: it joins the registry (so the gateway routes to it) only once it serves.
    Anything failing on the way stops the core and closes the server."""
    opened = open_service(
        service,
        specs,
        interceptors=security.worker_interceptors(),
        metrics_secret=security.metrics_secret(service.metrics_bind_host, service.metrics_port),
    )
    metrics = opened.metrics
    core: EngineCoreClient | None = None
    try:
        tokenizer = load_tokenizer(service.model) if detokenizes else None
        core = start_core(role, service, worker, tracing, security, tokenizer, core_entry)
        core.on_kv = KVTransferMetrics(metrics).observe
        registry = Registry(
            service.redis_url, retry_s=service.registry_retry_s, secret=security.cluster_secret
        )
        metrics.registry.register(EngineCollector(_stats_of(core), metrics.model_name))
        # NOTE: the heartbeat never waits on a step; a loop that stops turning takes the worker
        # out of the registry (runtime/engine_watch.py)
        watch = EngineWatch(functools.partial(core.submit, "stats"), worker.engine_stall_s)
        served = wire(Loaded(opened, core, core.info, registry, watch))
        when_core_dies(core, opened, served.presence, on_core_death)
    except BaseException:
        if core is not None:
            core.stop()
        opened.close()
        raise
    if served.pending is not None:
        opened.lifecycle.also_wait_for(served.pending)
    pauses = settle(f"{role} worker")
    opened.lifecycle.set_serving()
    try:
        # NOTE: after SERVING: a worker the gateway finds in the registry takes its calls (one
        # that answered "loading" was once taken for a dead prefill worker)
        served.presence.start()
    except BaseException:
        core.stop()
        opened.close()
        raise
    engine_core = core

    def stop() -> None:
        opened.lifecycle.start_draining()
        served.presence.stop()
        for step in served.leave:
            step()
        opened.server.stop()
        for step in served.close:
            step()
        engine_core.stop()
        registry.close()
        metrics.close()
        pauses.log_summary()

    leave = served.presence.step_aside  # NOTE: a KV peer until it stops (kv_transfer/presence.py)
    return Running(
        opened.server, opened.address, opened.lifecycle, metrics, stop, leave, served.worker
    )


def prefill_worker(
    loaded: Loaded,
    senders: Senders,
    service: ServiceSettings,
    worker: WorkerSettings,
    tracing: Tracing,
    metrics: Metrics,
) -> PrefillWorker:
    """The prefill side of a worker: prefills on its engine core, pushes with `senders`."""
    requests = RequestMetrics(
        metrics, ("request_queue_time", "request_prefill_time"), outcomes=False
    )
    return PrefillWorker(
        loaded.core,
        loaded.registry,
        senders,
        PrefillSettings(service.worker_id, lease_s=worker.lease_s),
        PrefillObserver(tracing, requests, metrics.model_name),
    )
