"""The prefill worker's logic: take the write lease, have the engine core prefill and push the
blocks (`prefill_service/core.py`), return the first tokens.

`prefill` blocks until every block is pushed: the servicer runs it on a thread of its own, which
renews the Redis write lease meanwhile and tells the core when the caller went away."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from opentelemetry.context import Context

from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.stats import EngineStats
from splitserve.kv_transfer.registry import Registry, RegistryUnavailable
from splitserve.kv_transfer.transport import TransferError
from splitserve.prefill_service.observer import PrefillObservation, PrefillObserver
from splitserve.prefill_service.pusher import Senders
from splitserve.protos.v1 import worker_pb2
from splitserve.runtime.engine_core.client import EngineCoreClient
from splitserve.runtime.engine_core.protocol import output_from_entry, params_to_wire


@dataclass(frozen=True)
class PrefillSettings:
    worker_id: str
    lease_s: float = 10.0
    send_timeout_s: float = 60.0


@dataclass(frozen=True)
class PrefillResult:
    output: RequestOutput  # holds the first token of each sample
    num_blocks_sent: int
    num_bytes_sent: int


class PrefillWorker:
    def __init__(
        self,
        core: EngineCoreClient,
        registry: Registry,
        senders: Senders,
        settings: PrefillSettings,
        observer: PrefillObserver,
    ) -> None:
        self.core = core
        self.observer = observer
        self.registry = registry
        self.senders = senders
        self.settings = settings
        self.num_bytes_sent = 0
        self._observations: dict[str, PrefillObservation] = {}
        core.on_progress = self._on_progress

    def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        destination: worker_pb2.KVDestination,
        priority: int,
        is_active: Callable[[], bool],
        trace_parent: Context | None = None,
    ) -> PrefillResult:
        """Prefill into `destination`'s reserved blocks; return once all are acknowledged."""
        obs = self.observer.start(
            request_id, len(prompt_token_ids), params, destination.num_cached_tokens, trace_parent
        )
        try:
            result = self._prefill(
                request_id, prompt_token_ids, params, destination, priority, is_active, obs
            )
        except BaseException as exc:
            obs.end(exc)
            raise
        obs.finish(result.num_blocks_sent, result.num_bytes_sent)
        obs.end(None)
        return result

    def _prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        destination: worker_pb2.KVDestination,
        priority: int,
        is_active: Callable[[], bool],
        obs: PrefillObservation,
    ) -> PrefillResult:
        s = self.settings
        self.registry.begin_write(request_id, s.worker_id, destination.fence, s.lease_s)
        self._observations[request_id] = obs
        try:
            # NOTE: in the try: a destination that published no endpoint is unreachable too
            route = self.senders.route(destination)
            peer = route.peer
            future = self.core.submit(
                "prefill",
                request_id,
                prompt_token_ids,
                params_to_wire(params),
                priority,
                destination.SerializeToString(),
                route.transport,
                [peer.worker_id, peer.address, peer.endpoint],
                self.observer.tracing.carrier(obs.span),
                s.send_timeout_s,
            )
            lease = _Lease(self.registry, request_id, destination.fence, s.lease_s)
            cancelled = False
            while True:
                try:
                    entry, num_blocks, num_bytes = future.result(timeout=0.05)
                    break
                except FutureTimeout:
                    if not cancelled and not is_active():
                        cancelled = True  # NOTE: the core answers Cancelled once settled
                        self.core.call("cancel", request_id)
                    lease.renew_if_due()
        except TransferError as exc:
            self.senders.forget(destination.worker_id)
            if exc.status != "UNAVAILABLE" or not self.core.running:
                raise
            # NOTE: the destination, not this worker, is unreachable: ABORTED tells the gateway
            # to retry with a fresh reservation (elsewhere) without writing this worker off.
            raise TransferError(str(exc), "ABORTED") from exc
        finally:
            self._observations.pop(request_id, None)
        self.num_bytes_sent += num_bytes
        return PrefillResult(output_from_entry(entry, prompt_token_ids), num_blocks, num_bytes)

    def _on_progress(self, progress: dict[str, int]) -> None:
        for request_id, computed in progress.items():
            obs = self._observations.get(request_id)
            if obs is not None:
                obs.on_progress(computed)

    @property
    def num_in_flight(self) -> int:
        """Prefills running on this worker now."""
        return len(self._observations)

    async def abort(self, request_id: str) -> bool:
        if not self.core.running:
            return False
        aborted = await self.core.acall("abort", request_id)
        # NOTE: a core that also decodes (--role-switch) answers [engine had it, reserved]
        return bool(aborted[0] if isinstance(aborted, list) else aborted)

    async def stats(self) -> EngineStats:
        return EngineStats(**await self.core.acall("stats"))

    async def load_adapter(self, name: str, path: str) -> list[str]:
        """Load a LoRA adapter into the engine; the adapters it then serves."""
        return list(await self.core.acall("load_adapter", name, path))

    async def unload_adapter(self, name: str) -> list[str]:
        """Unload one (refused while a request uses it); the adapters it then serves."""
        return list(await self.core.acall("unload_adapter", name))

    def close(self) -> None:
        """The engine core closes the senders when it stops."""


class _Lease:
    """Renews a write lease while the request is alive on this worker."""

    def __init__(self, registry: Registry, request_id: str, fence: int, lease_s: float) -> None:
        self.registry, self.request_id, self.fence, self.lease_s = (
            registry, request_id, fence, lease_s,
        )  # fmt: skip
        self._last = time.monotonic()

    def renew_if_due(self) -> None:
        if time.monotonic() - self._last > self.lease_s / 3:
            # NOTE: a renewal Redis missed is tried again next turn; the lease has room for it.
            with contextlib.suppress(RegistryUnavailable):
                self.registry.renew(self.request_id, self.fence, self.lease_s)
            self._last = time.monotonic()
