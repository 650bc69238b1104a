"""The prefill worker's logic: take the write lease, prefill, push blocks, return first tokens.

`prefill` blocks until every block is pushed: the servicer runs it on a thread of its own."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.context import Context

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.errors import Cancelled
from splitserve.engine.kv_connector import KVOutbox
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kv_transfer.registry import Registry, RegistryUnavailable
from splitserve.kv_transfer.transport import TransferError
from splitserve.prefill_service.observer import PrefillObservation, PrefillObserver
from splitserve.prefill_service.pusher import RequestPusher, Senders
from splitserve.protos.v1 import worker_pb2


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
        loop: EngineLoop,
        registry: Registry,
        senders: Senders,
        settings: PrefillSettings,
        observer: PrefillObserver,
    ) -> None:
        self.loop = loop
        self.observer = observer
        self.registry = registry
        self.senders = senders
        self.settings = settings
        self.num_bytes_sent = 0

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
        route = self.senders.route(destination)
        connector = self.loop.engine.kv_connector
        pusher = RequestPusher(request_id, destination, route, connector, s.send_timeout_s)
        first_block = destination.num_cached_tokens // connector.block_size

        def add(engine: LLMEngine) -> KVOutbox:
            engine.add_request(prompt_token_ids, params, request_id, priority, prefill_only=True)
            return engine.kv_connector.watch(request_id, first_block)

        outputs = self.loop.subscribe(request_id)
        self.loop.add_step_hook(obs.on_step)
        finished = False
        try:
            outbox = self.loop.call(add)
            lease = _Lease(self.registry, request_id, destination.fence, s.lease_s)
            output: RequestOutput | None = None
            while output is None or not pusher.done:
                if output is None:
                    # NOTE: once every block is out, wait on the first token itself (published
                    # just after the last batch), not on an outbox that has nothing more.
                    output = _finished_output(outputs, 0.02 if pusher.done else 0.0)
                    if pusher.done:
                        if output is None and not is_active():
                            raise Cancelled(f"prefill of {request_id!r} cancelled by the caller")
                        lease.renew_if_due()
                        continue
                try:
                    batch = outbox.get(timeout_s=0.02)
                except queue.Empty:
                    if not is_active():
                        raise Cancelled(
                            f"prefill of {request_id!r} cancelled by the caller"
                        ) from None
                    lease.renew_if_due()
                    continue
                # NOTE: runs under the request's span, so the transport's kv.push joins it.
                with obs.current():
                    pusher.send(batch)
            finished = True
            self.num_bytes_sent += pusher.num_bytes
            return PrefillResult(output, pusher.num_blocks, pusher.num_bytes)
        except TransferError:
            self.senders.forget(destination.worker_id)
            raise
        finally:
            self.loop.remove_step_hook(obs.on_step)
            self.loop.unsubscribe(request_id)
            connector.unwatch(request_id)  # unpins whatever was not sent (even if stopped)
            if self.loop.running:
                # NOTE: settled before the caller hears back: blocks are free once it does.
                self.loop.call(lambda e: _settle(e, request_id, aborted=not finished))

    async def abort(self, request_id: str) -> bool:
        return bool(await self.loop.call_async(lambda e: e.abort_request(request_id)))

    def close(self) -> None:
        self.senders.close()


def _settle(engine: LLMEngine, request_id: str, aborted: bool) -> None:
    if aborted:
        engine.abort_request(request_id)
    engine.housekeeping()


def _finished_output(outputs: queue.Queue, timeout_s: float = 0.0) -> RequestOutput | None:
    """The request's final output if it comes within `timeout_s` (raises what ended the
    engine)."""
    while True:
        try:
            item = outputs.get(timeout=timeout_s) if timeout_s > 0 else outputs.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            return item


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
