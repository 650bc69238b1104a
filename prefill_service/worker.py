"""The prefill worker's logic: take the write lease, prefill, push blocks, return first tokens."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from opentelemetry.context import Context

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.errors import Cancelled
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kv_transfer.registry import Registry
from splitserve.kv_transfer.transport import KVTransport
from splitserve.prefill_service.observer import PrefillObservation, PrefillObserver
from splitserve.prefill_service.pusher import BlockPusher
from splitserve.protos.v1 import worker_pb2


@dataclass(frozen=True)
class PrefillSettings:
    worker_id: str
    lease_s: float = 10.0
    send_timeout_s: float = 60.0
    max_concurrent_sends: int = 4


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
        transport: KVTransport,
        settings: PrefillSettings,
        observer: PrefillObserver,
    ) -> None:
        self.loop = loop
        self.observer = observer
        self.registry = registry
        self.transport = transport
        self.settings = settings
        self._executor = ThreadPoolExecutor(settings.max_concurrent_sends, "kv-push")
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
        pusher = BlockPusher(
            request_id,
            destination,
            len(prompt_token_ids),
            self.loop.engine.config.block_size,
            self.transport,
            self._executor,
            s.send_timeout_s,
            obs.context,
        )
        outputs = self.loop.subscribe(request_id)
        self.loop.add_step_hook(obs.on_step)
        self.loop.add_step_hook(pusher.on_step)
        done = False
        try:
            self.loop.call(
                lambda e: e.add_request(
                    prompt_token_ids, params, request_id, priority, prefill_only=True
                )
            )
            output = self._wait_finished(request_id, destination.fence, outputs, is_active)
            num_blocks, num_bytes = pusher.wait(s.send_timeout_s)
            done = True
            self.num_bytes_sent += num_bytes
            return PrefillResult(output, num_blocks, num_bytes)
        finally:
            self.loop.remove_step_hook(pusher.on_step)
            self.loop.remove_step_hook(obs.on_step)
            self.loop.unsubscribe(request_id)
            if not done:
                pusher.cancel()
            if self.loop.running:
                self.loop.call(lambda e: e.abort_request(request_id))  # frees held blocks

    def _wait_finished(
        self,
        request_id: str,
        fence: int,
        outputs: queue.Queue,
        is_active: Callable[[], bool],
    ) -> RequestOutput:
        renew_every = self.settings.lease_s / 3
        last_renew = time.monotonic()
        while True:
            try:
                item = outputs.get(timeout=0.1)
            except queue.Empty:
                if not is_active():
                    raise Cancelled(f"prefill of {request_id!r} cancelled by the caller") from None
                if time.monotonic() - last_renew > renew_every:
                    self.registry.renew(request_id, fence, self.settings.lease_s)
                    last_renew = time.monotonic()
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                return item

    def abort(self, request_id: str) -> bool:
        return bool(self.loop.call(lambda e: e.abort_request(request_id)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
