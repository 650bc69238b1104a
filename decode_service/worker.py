"""The decode worker's logic: reserve blocks, receive KV, admit into the batch, stream tokens.

Ownership in Redis follows each request: `reserve` (here, at Reserve) -> `begin_write` (the
prefill worker, before its first push) -> `handoff` (here, at Decode) -> `release` (here, when
the request finishes or is aborted). Reservations whose record expired are reclaimed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.errors import FailedPrecondition, NotFound
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput, SampledToken
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kv_transfer.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSettings:
    worker_id: str
    address: str  # where prefill workers push KV (this worker's gRPC address)
    lease_s: float = 10.0
    # How long Decode waits for blocks still landing (a one-sided transport's notification
    # can trail the prefill worker's answer).
    landing_timeout_s: float = 30.0
    kv_transports: tuple[str, ...] = ("grpc",)  # what this worker receives with, fastest first


class DecodeWorker:
    def __init__(
        self,
        loop: EngineLoop,
        registry: Registry,
        settings: DecodeSettings,
        reservations: ReservationBook,
    ) -> None:
        self.loop = loop
        self.registry = registry
        self.settings = settings
        self.reservations = reservations
        self._active: dict[str, int] = {}  # admitted request id -> fence (leases to renew)
        self._active_lock = threading.Lock()
        self.num_reclaimed = 0
        self.num_bytes_received = 0  # KV of admitted requests (pushes of others are dropped)
        self.num_blocks_received = 0

    @property
    def engine(self) -> LLMEngine:
        """For read-only lookups (config, sizes); changes go through `loop.call`."""
        return self.loop.engine

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> LocalReservation:
        """Hold blocks for the prompt and record the reservation (with a lease) in Redis."""
        res = self.loop.call(lambda e: e.reserve(request_id, prompt_token_ids, params))
        try:
            record = self.registry.reserve(
                request_id, self.settings.worker_id, list(res.block_ids), self.settings.lease_s
            )
        except Exception:
            self.loop.call(lambda e: e.abort_request(request_id))
            raise
        local = LocalReservation(
            request_id=request_id,
            fence=record.fence,
            block_ids=res.block_ids,
            num_cached_tokens=res.num_cached_tokens,
            block_size=self.engine.config.block_size,
        )
        self.reservations.add(local)
        return local

    def decode(
        self,
        request_id: str,
        params: SamplingParams,
        first_tokens: list[SampledToken],
        priority: int,
        is_active: Callable[[], bool],
        on_admitted: Callable[[], None] | None = None,
    ) -> Generator[RequestOutput, None, None]:
        """Admit a reserved request and yield its outputs until it finishes.

        With no `first_tokens` the prompt is prefilled here (colocated or short prompts).
        The request is aborted, and its blocks freed, if the caller goes away.
        """
        res = self.reservations.get(request_id)
        if res is None:
            raise NotFound(f"no reservation for request {request_id!r}")
        if first_tokens and not res.wait_complete(self.settings.landing_timeout_s):
            why = res.refusal or ("reclaimed" if res.dead else "timed out")
            self.abort(request_id)  # NOTE: never admitted with partial KV; nothing is kept
            raise FailedPrecondition(
                f"KV for request {request_id!r} is incomplete ({why}): {res.progress()} received"
            )
        self.reservations.pop(request_id)
        self.num_bytes_received += res.num_bytes
        self.num_blocks_received += len(res.received)
        outputs = self.loop.subscribe(request_id)
        finished = False
        try:
            self.registry.handoff(
                request_id, self.settings.worker_id, res.fence, self.settings.lease_s
            )
            with self._active_lock:
                self._active[request_id] = res.fence
            self.loop.publish(
                self.loop.call(lambda e: e.admit(request_id, params, first_tokens, priority))
            )
            if on_admitted is not None:
                on_admitted()
            while not finished:
                try:
                    item = outputs.get(timeout=0.1)
                except queue.Empty:
                    if not is_active():
                        return
                    continue
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.loop.unsubscribe(request_id)
            if not finished:
                self._abort_engine(request_id)
            with self._active_lock:
                self._active.pop(request_id, None)
            self.registry.release(request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a reservation or a running request; True if there was one."""
        res = self.reservations.pop(request_id)
        aborted = self._abort_engine(request_id)
        if res is not None:
            self.registry.release(request_id, res.fence)
        return aborted or res is not None

    def _abort_engine(self, request_id: str) -> bool:
        if not self.loop.running:
            return False
        return bool(self.loop.call(lambda e: e.abort_request(request_id)))

    def housekeeping(self) -> None:
        """Reclaim reservations whose lease expired; renew leases of running requests; mirror
        prefix-cache changes into the registry's prefix index."""
        self._publish_prefix_events()
        pending = self.reservations.ids()
        if pending:
            for request_id in self.registry.expired_requests(pending):
                if self.reservations.pop(request_id) is not None:
                    log.warning("reclaiming blocks of %s: its lease expired", request_id)
                    self._abort_engine(request_id)
                    self.num_reclaimed += 1
        with self._active_lock:
            active = dict(self._active)
        for request_id, fence in active.items():
            self.registry.renew(request_id, fence, self.settings.lease_s)

    def _publish_prefix_events(self) -> None:
        events = self.loop.call(lambda e: e.take_prefix_events())
        final: dict[bytes, bool] = {}
        for added, block_hash in events:
            final[block_hash] = added  # only the last change of each hash matters
        added_hashes = [h for h, added in final.items() if added]
        removed = [h for h, added in final.items() if not added]
        worker_id = self.settings.worker_id
        if added_hashes:
            self.registry.add_prefix_blocks(worker_id, added_hashes)
        if removed:
            self.registry.remove_prefix_blocks(worker_id, removed)

    def leave_prefix_index(self) -> None:
        self.registry.clear_prefix_blocks(self.settings.worker_id)
