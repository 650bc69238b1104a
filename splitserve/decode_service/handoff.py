"""Decode streams a worker moves off as it changes role (`--role-switch`, decode -> prefill),
with their KV handed to the decode worker that resumes them instead of recomputed there:

    move:     each running stream parked in the engine (out of the batch, blocks kept:
              engine/parking.py), then its Decode ends UNAVAILABLE "changing role", with the
              trailer `splitserve-kv-handoff: <tokens its KV covers>`
    gateway:  Reserve on D2 (resume = the tokens the client has) ──▶ HandOff here
              ──▶ Decode on D2 with `kv_handed_off` (it decodes on, nothing recomputed)
    HandOff:  push the KV of the tokens D2 needs into its reservation (this worker's KV senders:
              splitserve/roles/handoff_core.py); the blocks here are freed whatever the outcome

A stream that can't be parked (preempted, or admitted a moment ago) ends with no trailer and is
recomputed on D2, as when a worker dies. A parked stream's block record in Redis stays this
worker's (renewed) until its HandOff, an Abort, or its lease (`lease_s`) running out frees it:
nothing waits on a gateway that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.errors import FailedPrecondition, NotFound, Unavailable, quoted
from splitserve.kv_transfer.registry import BlockRecord, Registry
from splitserve.kv_transfer.transport import Peer
from splitserve.protos.v1 import worker_pb2
from splitserve.runtime.engine_core.client import EngineCoreClient

if TYPE_CHECKING:
    from splitserve.decode_service.worker import DecodeSettings

log = logging.getLogger(__name__)


class StreamMoved(Unavailable):
    """A Decode stream ended because its worker changes role; `num_kv_tokens`: the tokens whose
    KV it keeps for a hand-off (None: none kept, the stream is recomputed where it resumes)."""

    def __init__(self, message: str, num_kv_tokens: int | None = None) -> None:
        super().__init__(message)
        self.num_kv_tokens = num_kv_tokens


@dataclass(frozen=True)
class KVRoute:
    """How this worker pushes KV (a `--role-switch` worker's senders): the transport and peer
    for a destination, and how long one push may take."""

    route: Callable[[worker_pb2.KVDestination], tuple[str, Peer]]
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Parked:
    fence: int
    block_ids: tuple[int, ...]
    expires: float  # time.monotonic() when it is freed if no HandOff came


class StreamHandOffs:
    """The parked streams of one decode worker and their hand-offs (see the module doc)."""

    def __init__(
        self, core: EngineCoreClient, registry: Registry, settings: DecodeSettings
    ) -> None:
        self.core, self.registry, self.settings = core, registry, settings
        self.route: KVRoute | None = None  # None: no KV senders (streams are recomputed)
        self.num_sent = 0
        self._parked: dict[str, Parked] = {}
        self._lock = threading.Lock()

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._parked

    def pop(self, request_id: str) -> Parked | None:
        with self._lock:
            return self._parked.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked)

    async def park(self, request_id: str, record: tuple[int, tuple[int, ...]] | None) -> int | None:
        """Park an admitted stream (`record`: its fence and blocks) for a hand-off: the tokens
        its KV covers, or None (no senders, not admitted, or no KV to keep)."""
        if self.route is None or record is None or not self.core.running:
            return None
        try:
            num_tokens = await self.core.acall("park", request_id)
        except Exception:  # noqa: BLE001 - the engine stopped: nothing to keep
            log.debug("could not park %s", quoted(request_id), exc_info=True)
            return None
        if num_tokens is not None:
            with self._lock:
                expires = time.monotonic() + self.settings.lease_s
                self._parked[request_id] = Parked(record[0], record[1], expires)
        return num_tokens

    async def hand_off(
        self,
        request_id: str,
        destination: worker_pb2.KVDestination,
        destination_request_id: str,
        num_tokens: int,
    ) -> tuple[int, int]:
        """Push parked `request_id`'s KV of `num_tokens` tokens into `destination` (held under
        `destination_request_id`); (blocks, bytes) sent. Its blocks and record here are freed
        whatever happens."""
        parked = self.pop(request_id)
        if parked is None:
            raise NotFound(f"no KV kept for request {quoted(request_id)} (aborted or lapsed)")
        me, lease_s = self.settings.worker_id, self.settings.lease_s
        try:
            if self.route is None:
                raise FailedPrecondition("this worker has no KV senders")
            transport, peer = await asyncio.to_thread(self.route.route, destination)
            # NOTE: as a prefill worker does before its first push: the record says who writes
            await asyncio.to_thread(
                self.registry.begin_write, destination_request_id, me, destination.fence, lease_s
            )
            timeout_s = self.route.timeout_s
            num_blocks, num_bytes = await self.core.acall(
                "hand_off", request_id, destination.SerializeToString(), destination_request_id,
                num_tokens, transport, [peer.worker_id, peer.address, peer.endpoint], timeout_s,
                timeout_s=timeout_s + 30,
            )  # fmt: skip
        except BaseException:
            if self.core.running:  # NOTE: frees the blocks if the core did not get to them
                with contextlib.suppress(Exception):
                    await self.core.acall("abort", request_id)
            raise
        finally:
            await asyncio.to_thread(self.registry.release_quietly, request_id, parked.fence)
        self.num_sent += 1
        log.info(
            "handed off the KV of %s (%d tokens, %d blocks) to %s",
            quoted(request_id), num_tokens, num_blocks, destination.worker_id,
        )  # fmt: skip
        return num_blocks, num_bytes

    def housekeeping(self) -> None:
        """Renew the records of parked streams; free those whose hand-off did not come."""
        now = time.monotonic()
        with self._lock:
            parked = dict(self._parked)
            lapsed = [r for r, p in parked.items() if p.expires <= now]
            for request_id in lapsed:
                del self._parked[request_id]
        for request_id in lapsed:
            log.warning("freeing the KV kept for %s: no hand-off came", quoted(request_id))
            if self.core.running:
                self.core.call("abort", request_id)
            self.registry.release_quietly(request_id, parked[request_id].fence)
        kept = {r: p.fence for r, p in parked.items() if r not in lapsed}
        self.registry.renew_many(kept, self.settings.lease_s)

    def records(self) -> list[BlockRecord]:
        """The block records of parked streams (this worker owns them until handed off)."""
        me = self.settings.worker_id
        with self._lock:
            parked = dict(self._parked)
        return [
            BlockRecord(r, "owned", me, "", p.fence, p.block_ids, None) for r, p in parked.items()
        ]
