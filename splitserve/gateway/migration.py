"""Decode streams that outlive their decode worker, and deadlines on the calls to workers.

A Decode stream ends early in three ways: its worker dies (the call fails UNAVAILABLE:
connection refused or reset), it stops answering (frozen, swapped out: no message for
`stall_timeout_s` while it is gone from the registry: its heartbeat lapsed, or its engine loop
stopped turning and it left, `runtime/engine_watch.py`), or it changes role (`--role-switch`:
UNAVAILABLE "changing role"; it is not lost, so not made suspect). Either way the gateway knows
everything the stream depends on: the prompt, the sampling parameters, and the tokens the
client already has. It resumes the stream on another decode worker:

    client ◀══ tokens 0..k ══ gateway ◀══ D1 ✗ (dead, or silent with no heartbeat)
                                 │ D1 marked suspect; its call cancelled, its request aborted
                                 ├──Reserve(prompt, resume = tokens 0..k)──▶ D2
                                 └──Decode(resume)──▶ D2: recomputes the KV of prompt + tokens
    client ◀══ tokens k+1.. ══ gateway ◀══ D2      (locally), samples token k+1 as D1 would have

The continuation is the one D1 would have produced: a seeded draw is keyed by (seed, sample,
position), not carried from step to step, and the resumed tokens count as generated for
penalties, min_tokens and max_tokens (`engine.sequence.Resume`). D2 streams only what follows
what the client has, so the client sees one stream; usage counts the original prompt and every
generated token. On D2 the request runs under a new id (`<id>~<k>`): D1's records in Redis and
D1 itself, should it wake up, never touch D2's.

A worker that changes role is alive and keeps the stream's KV (its status's trailer says for how
many tokens): then D1 pushes that KV into D2's reservation (`HandOff`, `handoff.py`) between
the Reserve and the Decode, and D2 decodes on without recomputing anything; a hand-off that
fails falls back to the recompute above. `splitserve:stream_migrations_total{reason, kv}`
counts each move, `kv` handed_off or recomputed.

A Decode can also come after its reservation's lease lapsed (Reserve and Decode more than
`--lease-s` apart on an overloaded host). The decode worker writes the record again if it still
holds the blocks (`Registry.handoff`); if it took them back already, the Decode fails NOT_FOUND
before any token, and the sample is reserved again (on any decode worker, that one too: it is not
suspect) and its KV recomputed.

A Prefill whose KV goes to a decode worker that goes silent the same way is cancelled and
fails ABORTED, which the orchestrator retries with a fresh reservation. A worker that misses a
deadline (a Reserve not answered in `reserve_timeout_s`, a stalled stream or prefill) is
*suspect* for `suspect_s`: new requests go to other workers while any is live. Both deadlines
are paced by the worker's own recent waits (`runtime/pace.py`): three times its longest recent
Reserve answer or gap between two stream messages, when that is longer, so a worker whose
steps legitimately take a second is not taken for a frozen one.

How long a freeze costs: a silent stream is first checked after `stall_timeout_s` (paced),
then every quarter of it, against the registry, which drops a frozen worker
`--heartbeat-ttl-s` after its last heartbeat (a frozen process) or `--engine-stall-s` (paced
the same way) after its loop's last turn (a frozen engine core). A new request sent meanwhile
waits about `reserve_hedge_s` on that worker: its Reserve is hedged on another (`hedge.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from splitserve.engine.errors import Unavailable
from splitserve.engine.outputs import handoff_kv_tokens
from splitserve.gateway.failover import FailoverSettings
from splitserve.gateway.handoff import (
    HANDED_OFF,
    RECOMPUTED,
    hand_off,
    kv_kept,
)
from splitserve.gateway.observability import DECODE, RequestObservation
from splitserve.gateway.route import Route, remaining
from splitserve.gateway.stream_watch import WorkerLost, watched
from splitserve.gateway.validation import Job
from splitserve.kv_transfer.registry import WorkerInfo
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2

if TYPE_CHECKING:
    from splitserve.gateway.orchestrator import Orchestrator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Moved:
    """One move of a stream: its number, why, and the tokens of KV its worker kept (None)."""

    move: int
    reason: str
    kv_kept: int | None


# NOTE: what a decode worker that changes role (`--role-switch`) says as it ends the streams it
# hands off (decode_service/worker.py, `DecodeWorker.move_streams`): it is not lost, so it is
# not made suspect (it may serve as a decode worker again a moment later).
ROLE_CHANGE = "changing role"
# A Decode that found no reservation: its lease lapsed (and its worker took the blocks back)
# before the Decode came, on a host too busy to keep within `--lease-s`. Nothing was streamed
# from it: the sample is reserved again, on any decode worker, and its KV recomputed.
LAPSED = "reservation lapsed"


def _why_moved(err: BaseException) -> str:
    if isinstance(err, WorkerLost):
        return "stalled"
    details = err.details() if isinstance(err, grpc.RpcError) else ""  # type: ignore[attr-defined]
    return ROLE_CHANGE if ROLE_CHANGE in (details or "") else "unavailable"


def is_reservation_lapsed(err: BaseException, num_messages: int) -> bool:
    """Whether a Decode failed because its reservation was gone before it came (see LAPSED)."""
    not_found = isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.NOT_FOUND
    return not_found and num_messages == 0


def is_worker_lost(err: BaseException) -> bool:
    """Whether a failed call means its worker is gone (dead, or unreachable), not the request."""
    if isinstance(err, WorkerLost):
        return True
    return isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE


class Ledger:
    """What the client has received of each sample: where a resumed stream goes on from.

    NOTE: it keeps the messages and reads them only when a stream moves: reading a protobuf
    message's fields costs more than keeping it, and most streams never move."""

    def __init__(self) -> None:
        self.messages: list[worker_pb2.DecodeResponse] = []

    def record(self, msg: worker_pb2.DecodeResponse) -> None:
        self.messages.append(msg)

    def _chunks(self, index: int) -> list[Any]:
        return [m.chunk for m in self.messages if m.HasField("chunk") and m.chunk.index == index]

    def resume_from(self, index: int) -> worker_pb2.ResumeFrom:
        chunks = self._chunks(index)
        return worker_pb2.ResumeFrom(
            sample_index=index,
            output_token_ids=[t for c in chunks for t in c.token_ids],
            num_text_chars=sum(len(c.text) for c in chunks),
        )

    @property
    def num_tokens(self) -> int:
        return sum(len(m.chunk.token_ids) for m in self.messages if m.HasField("chunk"))


class StreamMover:
    """Runs a request's Decode stream and moves it to another decode worker when its own is
    lost (see the module doc). Owned by the Orchestrator; one call of `stream` per request."""

    def __init__(self, orchestrator: Orchestrator, settings: FailoverSettings) -> None:
        self.orch = orchestrator
        self.settings = settings
        self._background: set[asyncio.Future[Any]] = set()
        # kind -> (when asked, ids of its live workers); one registry read serves every stream
        # checked within LIVE_CACHE_S (a freeze silences all of a worker's streams at once)
        self._live: dict[str, tuple[float, frozenset[str] | None]] = {}
        self._asking: dict[str, asyncio.Future[frozenset[str] | None]] = {}

    async def stream(
        self,
        job: Job,
        route: Route,
        first: list[worker_pb2.FirstToken],
        deadline: float,
        obs: RequestObservation,
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        orch, settings = self.orch, self.settings
        ledger = Ledger()
        resume: worker_pb2.ResumeFrom | None = None
        handed_off = False  # the resumed stream's KV was handed off into its reservation
        for moves in range(settings.max_migrations + 1):
            worker_request_id = route.worker_request_id or job.request_id
            num_messages = 0
            try:
                with obs.call(DECODE, route.decode) as call:
                    stream = orch.stubs.decode_stream(
                        route.decode.address,
                        worker_pb2.DecodeRequest(
                            request_id=worker_request_id,
                            sampling=convert.sampling_to_proto(job.params),
                            first_tokens=first,
                            priority=job.priority,
                            resume=resume,
                            kv_handed_off=handed_off,
                        ),
                        remaining(deadline),
                        call.metadata,
                    )
                    orch._track(route, stream)
                    worker_id = route.decode.worker_id
                    is_live = functools.partial(self._is_live, route.decode)
                    stall_s = functools.partial(
                        orch.paces.deadline, worker_id, settings.stall_timeout_s
                    )
                    on_gap = functools.partial(orch.paces.observe, worker_id)
                    async for msg in watched(stream, stall_s, is_live, on_gap):
                        num_messages += 1
                        ledger.record(msg)
                        yield msg
                return
            except (grpc.RpcError, WorkerLost) as err:
                movable = job.params.n == 1 and not route.cancelled
                lapsed = is_reservation_lapsed(err, num_messages)
                lost = lapsed or is_worker_lost(err)
                if not (lost and movable and moves < settings.max_migrations):
                    if isinstance(err, WorkerLost):
                        raise Unavailable(
                            f"decode worker {route.decode.worker_id}: {err}"
                        ) from None
                    raise
                stream.cancel()  # NOTE: should the worker wake up, it frees the request
                reason = LAPSED if lapsed else _why_moved(err)
                resume = ledger.resume_from(0)
                moved = _Moved(moves + 1, reason, kv_kept(err) if reason == ROLE_CHANGE else None)
                handed_off = await self._move(job, route, resume, moved, deadline, obs, ledger)
                first = []
        raise AssertionError("unreachable")  # pragma: no cover

    async def _move(
        self,
        job: Job,
        route: Route,
        resume: worker_pb2.ResumeFrom,
        moved: _Moved,
        deadline: float,
        obs: RequestObservation,
        ledger: Ledger,
    ) -> bool:
        """Reserve the resumed sample on another decode worker; `route` then points there.
        True if the lost worker handed the sample's KV off into that reservation (`handoff.py`;
        otherwise the new worker recomputes it)."""
        orch = self.orch
        lost, lost_id = route.decode, route.worker_request_id or job.request_id
        if moved.reason not in (ROLE_CHANGE, LAPSED):
            why = f"its Decode stream was lost ({moved.reason})"
            orch.suspects.mark(lost.worker_id, why, "stream")
        need = handoff_kv_tokens(len(job.prompt_token_ids), len(resume.output_token_ids))
        kept = moved.kv_kept is not None and 0 < need <= moved.kv_kept
        if not kept:
            self.abort_in_background(lost, lost_id)
        lapsed = moved.reason == LAPSED  # NOTE: its worker is well: it may be picked again
        if not lapsed:
            # A killed worker's prefix index is gone with it: routing must stop preferring it.
            await asyncio.to_thread(orch.registry.clear_prefix_blocks, lost.worker_id)
        route.worker_request_id = f"{job.request_id}~{moved.move}"
        resumed = dataclasses.replace(job, request_id=route.worker_request_id)
        try:
            exclude = set() if lapsed else {lost.worker_id}
            picked = await orch._pick_decode(resumed, obs, exclude=exclude)
            route.move_to(picked)
            orch._count(lost.worker_id, -1)
            dest = await orch._reserve(resumed, route, deadline, obs, resume=resume)
            handed_off = kept and await hand_off(
                orch.stubs, lost, lost_id, dest, route.worker_request_id, need,
                min(self.settings.handoff_timeout_s, remaining(deadline)),
            )  # fmt: skip
        except BaseException:
            if kept:
                self.abort_in_background(lost, lost_id)  # NOTE: frees the KV it kept for us
            raise
        if kept and not handed_off:
            self.abort_in_background(lost, lost_id)
        kv = HANDED_OFF if handed_off else RECOMPUTED
        what = "its reservation lapsed on" if lapsed else "lost"
        log.warning(
            "request %s: decode worker %s %s (%s) after %d tokens; resumed on %s (KV %s)",
            job.request_id, lost.worker_id, what, moved.reason, ledger.num_tokens,
            route.decode.worker_id, kv.replace("_", " "),
        )  # fmt: skip
        obs.migrated(lost, route.decode, moved.reason, ledger.num_tokens, kv)
        return handed_off

    async def prefill_guarded(self, rpc: Any, decode: WorkerInfo) -> Any:
        """Await a Prefill call whose KV goes to `decode`. If `decode` goes silent and leaves
        the registry meanwhile (frozen: the pushes would wait out their send timeout), the call
        is cancelled and fails ABORTED, which the caller retries with a fresh reservation."""
        task = asyncio.ensure_future(_awaited(rpc))
        paces, floor_s = self.orch.paces, self.settings.stall_timeout_s
        wait_s = paces.deadline(decode.worker_id, floor_s)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=wait_s)
                if done:
                    return task.result()
                if not await self._is_live(decode):
                    break
                # NOTE: as `watched` asks again
                wait_s = paces.deadline(decode.worker_id, floor_s) / 4
        except asyncio.CancelledError:
            task.cancel()
            raise
        rpc.cancel()
        self.orch.suspects.mark(
            decode.worker_id, "it went silent while a prefill pushed to it", "prefill"
        )
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.ABORTED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=f"decode worker {decode.worker_id} went silent during the prefill",
        )

    async def _is_live(self, worker: WorkerInfo) -> bool:
        kind = worker.kind
        cached = self._live.get(kind)
        if cached is not None and time.monotonic() - cached[0] < LIVE_CACHE_S:
            ids = cached[1]
        else:
            asking = self._asking.get(kind)
            if asking is None:
                asking = asyncio.ensure_future(self._live_ids(kind))
                self._asking[kind] = asking
                asking.add_done_callback(lambda _: self._asking.pop(kind, None))
            ids = await asyncio.shield(asking)
        return ids is None or worker.worker_id in ids

    async def _live_ids(self, kind: str) -> frozenset[str] | None:
        """The ids of the live workers of `kind`; None if Redis did not answer."""
        asked = time.monotonic()
        try:
            live = await asyncio.to_thread(self.orch.registry.live_workers, kind)
        except Exception:  # noqa: BLE001 - Redis down: no evidence that the worker is gone
            # NOTE: the registry client warns once per outage; no traceback per request here
            log.debug("could not check which %s workers are live", kind, exc_info=True)
            ids = None
        else:
            ids = frozenset(w.worker_id for w in live)
        self._live[kind] = (asked, ids)
        return ids

    def abort_in_background(self, worker: WorkerInfo, request_id: str) -> None:
        """Abort the request on the lost worker without waiting: a frozen one answers late."""

        async def abort() -> None:
            try:
                await self.orch.stubs.decode(worker.address).Abort(
                    common_pb2.AbortRequest(request_id=request_id),
                    timeout=self.settings.rpc_timeout_s,
                )
            except grpc.RpcError as err:
                log.info("abort of %s on lost %s: %s", request_id, worker.worker_id, err.code())

        task = asyncio.ensure_future(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


LIVE_CACHE_S = 0.1  # how old a registry read may be when a silent stream's worker is checked


async def _awaited(call: Any) -> Any:
    return await call
