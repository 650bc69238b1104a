"""The decode worker's logic: reserve blocks, receive KV, admit into the batch, stream tokens.

Its gRPC handlers run on the server's event loop: `reserve`, `decode` and `abort` are coroutines
that wait for the engine core (`acall`, `subscribe_async`: the engine, its KV receivers and the
blocks landing live in the core process, `decode_service/core.py`) and for Redis (in a thread)
without blocking the loop; `housekeeping` runs on the heartbeat thread.

Ownership in Redis follows each request: `reserve` (here, at Reserve) -> `begin_write` (the
prefill worker, before its first push) -> `handoff` (here, at Decode) -> `release` (here, when
the request finishes or is aborted). Reservations whose record expired are reclaimed; records
that Redis lost in a restart are re-published from what this worker holds (`housekeeping`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from splitserve.decode_service.handoff import StreamHandOffs, StreamMoved
from splitserve.decode_service.pace import Pace
from splitserve.decode_service.prefix_mirror import PrefixMirror
from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.engine.errors import FailedPrecondition, NotFound, quoted
from splitserve.engine.outputs import RequestOutput, Resume, SampledToken, handoff_kv_tokens
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.stats import EngineStats
from splitserve.kv_transfer.registry import BlockRecord, Registry
from splitserve.runtime.engine_core.client import EngineCoreClient
from splitserve.runtime.engine_core.protocol import first_tokens_to_wire, params_to_wire

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
    # Tokens per message on a Decode stream at least (1: every step's; under load, steps that
    # queued up while the stream was busy go out as one message either way).
    stream_interval: int = 1


class DecodeWorker:
    def __init__(
        self,
        core: EngineCoreClient,
        registry: Registry,
        settings: DecodeSettings,
        reservations: ReservationBook,
    ) -> None:
        self.core = core
        self.registry = registry
        self.settings = settings
        self.reservations = reservations
        # admitted request id -> (fence, block ids): leases to renew, records to re-publish
        self._active: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._active_lock = threading.Lock()
        self.num_reclaimed = 0
        self.num_leases_rewritten = 0
        self.num_bytes_received = 0  # KV of admitted requests (pushes of others are dropped)
        self.num_blocks_received = 0
        self._background: set[asyncio.Future[bool]] = set()  # aborts of abandoned reservations
        # Reserves under way, so that an abort arriving meanwhile undoes what they grant
        self._reserving: dict[str, asyncio.Task[LocalReservation]] = {}
        self.prefix = PrefixMirror(core, registry, settings.worker_id, settings.lease_s)
        self._since = 0  # the registry's mark of its data's start, at the last `restore`
        # running Decode streams: their outputs queue, and the loop that feeds it (move_streams)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # streams moved off with their KV kept for a hand-off (decode_service/handoff.py)
        self.handoffs = StreamHandOffs(core, registry, settings)

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume: Resume | None = None,
        caller: str = "",
        adapter: str | None = None,
    ) -> LocalReservation:
        """Hold blocks for the prompt (and a resumed sample's tokens) and record the reservation
        (with a lease) in Redis. `caller` (the client the gateway acts for) may hold at most
        `--max-reservations-per-caller` reservations here at once (Overloaded beyond).

        NOTE: runs to its end even if the caller goes away meanwhile (blocks held by the engine
        must be recorded or given back), and then gives them back."""
        self.reservations.claim(request_id, caller)  # NOTE: at once, before any await
        task = asyncio.ensure_future(
            self._reserve(request_id, prompt_token_ids, params, resume, adapter)
        )
        task.add_done_callback(lambda t: self._unclaim_failed(t, request_id))
        self._reserving[request_id] = task
        task.add_done_callback(lambda t: self._reserving.pop(request_id, None))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._undo_reserve(t, request_id))
            raise

    async def _reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume: Resume | None,
        adapter: str | None = None,
    ) -> LocalReservation:
        wire_resume = None if resume is None else [resume.sample_index, resume.output_token_ids]
        block_ids, num_cached, window_slots = await self.core.acall(
            "reserve", request_id, prompt_token_ids, params_to_wire(params), wire_resume, adapter
        )
        try:
            record = await asyncio.to_thread(
                self.registry.reserve,
                request_id,
                self.settings.worker_id,
                list(block_ids),
                self.settings.lease_s,
            )
            local = LocalReservation(
                request_id=request_id,
                fence=record.fence,
                block_ids=tuple(block_ids),
                num_cached_tokens=num_cached,
                block_size=self.core.info["block_size"],
                capability=secrets.token_bytes(16),  # handed only to the prefill worker chosen
                prompt_token_ids=tuple(prompt_token_ids),
                window_slots=tuple(window_slots),
            )
            await self.core.acall(
                "open_landing", request_id, record.fence, block_ids, num_cached, local.capability,
                window_slots,
            )  # fmt: skip
        except BaseException:
            await self._abort_engine_async(request_id)
            raise
        self.reservations.add(local)
        return local

    def _unclaim_failed(self, task: asyncio.Task[LocalReservation], request_id: str) -> None:
        if task.cancelled() or task.exception() is not None:
            self.reservations.unclaim(request_id)

    def _undo_reserve(self, task: asyncio.Task[LocalReservation], request_id: str) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        undo = asyncio.ensure_future(self.abort(request_id))
        self._background.add(undo)
        undo.add_done_callback(self._background.discard)

    async def decode(
        self,
        request_id: str,
        params: SamplingParams,
        first_tokens: list[SampledToken],
        priority: int,
        on_admitted: Callable[[], None] | None = None,
        num_resumed_handed_off: int | None = None,
        direct: Callable[[RequestOutput], None] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Admit a reserved request and yield its outputs until it finishes.

        With no `first_tokens` the prompt is prefilled here (colocated or short prompts), or,
        with `num_resumed_handed_off` (a resumed stream of that many tokens whose KV of all but
        the last was handed off), it decodes on from that KV (recomputed if it did not land).
        The request is aborted, and its blocks freed, if the caller goes away (the task that
        iterates this is cancelled, or closes it early). With `direct`, plain outputs that come
        while this waits for one are sent with it instead of yielded (decode_service/pace.py).
        """
        res = self.reservations.get(request_id)
        if res is None:
            raise NotFound(
                f"no reservation for request {request_id!r} (never made, aborted, or its lease "
                "lapsed before this Decode)"
            )
        num_bytes = num_blocks = 0
        num_kv_tokens: int | None = None
        if num_resumed_handed_off is not None:
            num_kv_tokens = handoff_kv_tokens(len(res.prompt_token_ids), num_resumed_handed_off)
        if first_tokens or num_kv_tokens is not None:
            timeout_s = self.settings.landing_timeout_s
            ok, why, progress, num_bytes, num_blocks = await self.core.acall(
                "wait_landed", request_id, timeout_s, num_kv_tokens, timeout_s=timeout_s + 30
            )
            if not ok and num_kv_tokens is not None:
                log.warning("KV handed to %s incomplete (%s): recompute", quoted(request_id), why)
                num_kv_tokens = None
            elif not ok:
                await self.abort(request_id)  # NOTE: never admitted with partial KV
                raise FailedPrecondition(
                    f"KV for request {request_id!r} is incomplete ({why}): {progress} received"
                )
        if self.reservations.pop(request_id) is None:
            # NOTE: aborted (or reclaimed) while its KV landed: admitting it now would hold a
            # record and a stream that no output would ever end
            raise NotFound(f"the reservation of {request_id!r} ended while its KV landed")
        self.num_bytes_received += num_bytes
        self.num_blocks_received += num_blocks
        outputs = self.core.subscribe_async(
            request_id, list(res.prompt_token_ids), asyncio.get_running_loop()
        )
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        finished = False
        # NOTE: its own task, shielded, and settled before the record is released at the end:
        # a cancel must not leave its Redis write running, to write the record again after.
        handoff = asyncio.ensure_future(
            asyncio.to_thread(
                self.registry.handoff,
                request_id,
                self.settings.worker_id,
                res.fence,
                self.settings.lease_s,
                res.block_ids,  # NOTE: held here: a lapsed record is written again
            )
        )
        try:
            # NOTE: the ownership hand-off (Redis) and the admission (the engine's next turn)
            # run at once: the first token streams as soon as both are done.
            results: list[object] = await asyncio.gather(
                asyncio.shield(handoff),
                self.core.acall(
                    "admit",
                    request_id,
                    params_to_wire(params),
                    first_tokens_to_wire(first_tokens),
                    priority,
                    num_kv_tokens is not None,
                ),
                return_exceptions=True,  # NOTE: both settle before either's error is raised
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            if results[0] is True:
                self.num_leases_rewritten += 1
                log.warning(
                    "the lease of %s lapsed before its Decode came: record written again",
                    quoted(request_id),
                )
            with self._active_lock:
                self._active[request_id] = (res.fence, tuple(res.block_ids))
            if on_admitted is not None:
                on_admitted()
            pace = Pace(self.settings.stream_interval)
            if direct is not None:
                outputs.direct = pace.taker(direct)  # NOTE: decode_service/pace.py
            while not finished:
                item = await outputs.get()
                # NOTE: outputs are cumulative: what queued up while this stream was busy goes
                # out as one message (the newest holds every token).
                while not outputs.empty() and not isinstance(item, BaseException):
                    item = outputs.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if pace.due(item):
                    yield item
        finally:
            outputs.direct = None
            self._streams.pop(request_id, None)
            self.core.unsubscribe(request_id)
            # NOTE: shielded: a second cancel (the server stopping) must not leave it half done.
            await asyncio.shield(self._end(request_id, aborted=not finished, after=handoff))

    async def _end(
        self, request_id: str, aborted: bool, after: asyncio.Future[Any] | None = None
    ) -> None:
        """Free what the stream held; `after` (its ownership hand-off) settles first."""
        if after is not None:
            await asyncio.wait([after])
        with self._active_lock:
            self._active.pop(request_id, None)
        if self.handoffs.holds(request_id):
            return  # NOTE: moved off with its KV kept: its hand-off (or lease) frees it
        if aborted:
            await self._abort_engine_async(request_id)
        await asyncio.to_thread(self.registry.release_quietly, request_id)

    @property
    def num_in_flight(self) -> int:
        """Reservations and Decode streams this worker holds now."""
        return len(self._streams) + len(self.reservations)

    async def move_streams(self, why: str) -> int:
        """End every running Decode stream with UNAVAILABLE (`why`): the gateway resumes each
        on another decode worker (`gateway/migration.py`). A stream whose KV can be handed off
        keeps it here until then (decode_service/handoff.py); the others are aborted and
        recomputed there. How many it ended."""
        streams = list(self._streams.items())
        for request_id, (loop, outputs) in streams:
            with self._active_lock:
                record = self._active.get(request_id)
            num_kv_tokens = await self.handoffs.park(request_id, record)
            # NOTE: "changing role" tells the gateway this worker is not lost (migration.py)
            error = StreamMoved(f"changing role: {why}", num_kv_tokens)
            with contextlib.suppress(RuntimeError):  # NOTE: a closed loop: nobody reads it
                loop.call_soon_threadsafe(outputs.put_nowait, error)
        return len(streams)

    async def stats(self) -> EngineStats:
        return EngineStats(**await self.core.acall("stats"))

    async def load_adapter(self, name: str, path: str) -> list[str]:
        """Load a LoRA adapter into the engine; the adapters it then serves."""
        return list(await self.core.acall("load_adapter", name, path))

    async def unload_adapter(self, name: str) -> list[str]:
        """Unload one (refused while a request uses it); the adapters it then serves."""
        return list(await self.core.acall("unload_adapter", name))

    async def abort(self, request_id: str) -> bool:
        """Cancel a reservation or a running request; True if there was one."""
        return await asyncio.shield(self._abort(request_id))

    async def _abort(self, request_id: str) -> bool:
        reserving = self._reserving.get(request_id)
        if reserving is not None:
            # NOTE: an abort that overtakes its Reserve (a hedge's loser: the gateway aborts it
            # while the worker still grants it) undoes the grant once made, not left to lapse.
            reserving.add_done_callback(lambda t: self._undo_reserve(t, request_id))
        res = self.reservations.pop(request_id)
        parked = self.handoffs.pop(request_id)
        aborted = await self._abort_engine_async(request_id)
        for held in (res, parked):
            if held is not None:
                await asyncio.to_thread(self.registry.release_quietly, request_id, held.fence)
        return aborted or res is not None or parked is not None

    async def _abort_engine_async(self, request_id: str) -> bool:
        """Abort in the engine core: its reservation closed there first (waiting for a KV
        write into its blocks to end), then the engine frees the blocks."""
        if not self.core.running:
            return False
        aborted, _ = await self.core.acall("abort", request_id)
        return bool(aborted)

    def _abort_engine(self, request_id: str) -> bool:
        if not self.core.running:
            return False
        aborted, _ = self.core.call("abort", request_id)
        return bool(aborted)

    def housekeeping(self) -> None:
        """Re-publish records Redis lost; reclaim reservations whose lease expired; renew leases
        of running requests; mirror prefix-cache changes into the registry's prefix index."""
        # NOTE: before the reclaim, which would take a lost record for a lapsed one.
        self._since, restored = self.registry.restore(
            self._records(), self.settings.lease_s, self._since
        )
        if restored:
            log.warning("re-published %d block record(s) that Redis lost", restored)
        self.prefix.publish()
        pending = self.reservations.ids()
        if pending:
            for request_id in self.registry.expired_requests(pending):
                if self.reservations.pop(request_id) is not None:
                    log.warning("reclaiming blocks of %s: its lease expired", quoted(request_id))
                    self._abort_engine(request_id)
                    self.num_reclaimed += 1
        with self._active_lock:
            active = dict(self._active)
        fences = {request_id: fence for request_id, (fence, _) in active.items()}
        self.registry.renew_many(fences, self.settings.lease_s)
        self.handoffs.housekeeping()

    def _records(self) -> list[BlockRecord]:
        """The block records this worker holds: its reservations and running requests."""
        me = self.settings.worker_id
        records = []
        for request_id in self.reservations.ids():
            res = self.reservations.get(request_id)
            if res is not None:
                records.append(
                    BlockRecord(request_id, "reserved", me, "", res.fence, res.block_ids, None)
                )
        with self._active_lock:
            active = dict(self._active)
        for request_id, (fence, block_ids) in active.items():
            records.append(BlockRecord(request_id, "owned", me, "", fence, block_ids, None))
        return records + self.handoffs.records()
