"""Changing a worker's role in place (`--role-switch`): prefill <-> decode <-> colocated, in
seconds, with the model and the engine core kept.

A `--role-switch` worker serves both internal services (PrefillWorker and DecodeWorker) over one
engine (`switchable_core.py`); its role is what the registry lists it as, and so what the
gateway sends it. A switch:

    SetRole(to) ─▶ refuse new work of the old role (UNAVAILABLE: the gateway tries elsewhere)
               ─▶ leave the registry's routing (nothing new is routed here), a KV peer still
                  (its KV endpoint kept: what it pushes meanwhile is taken, what was reserved
                  here can still be pushed to)
               ─▶ drain the old role: prefills in flight finish; decode streams finish, and those
                  still running at the drain timeout end UNAVAILABLE "changing role", which the
                  gateway resumes on another decode worker (`gateway/migration.py`)
               ─▶ register under the new kind, serve it

A stream moved so keeps its KV here (out of the batch, its blocks held under a short lease) and
says so in its status's trailer; the gateway reserves it on another decode worker and has this
one push the KV there (`DecodeWorker.HandOff`, with this worker's KV senders: decode_service/
handoff.py), so the new worker decodes on without recomputing the prompt and the tokens so far.
A stream whose KV could not be kept (preempted, not yet admitted) or whose hand-off fails is
recomputed there, as when a worker dies. `SwitchResult.num_streams_moved` counts both.

decode <-> colocated needs no drain: both take the same calls, only the gateway's choice of
where to prefill differs. No request is lost: what is refused is retried by the gateway, what is
running finishes or moves.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.decode_service.worker import DecodeWorker
from splitserve.engine.errors import FailedPrecondition, InvalidRequest, Unavailable
from splitserve.kv_transfer.presence import Presence, Stalled
from splitserve.prefill_service.worker import PrefillWorker
from splitserve.protos.v1 import worker_pb2

log = logging.getLogger(__name__)

KINDS = ("prefill", "decode", "colocated")
# The calls that take new work, and the roles that take them.
ADMITTING = {"Reserve": ("decode", "colocated"), "Prefill": ("prefill",)}
_TO_WIRE = {
    "prefill": worker_pb2.WORKER_KIND_PREFILL,
    "decode": worker_pb2.WORKER_KIND_DECODE,
    "colocated": worker_pb2.WORKER_KIND_COLOCATED,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}


def kind_to_wire(kind: str) -> worker_pb2.WorkerKind:
    return _TO_WIRE[kind]


def kind_from_wire(value: int) -> str:
    kind = _FROM_WIRE.get(value)  # type: ignore[call-overload]
    if kind is None:
        raise InvalidRequest(f"kind must be prefill, decode or colocated, got {value}")
    return kind


@dataclass(frozen=True)
class SwitchResult:
    kind: str
    previous_kind: str
    seconds: float
    num_streams_moved: int


class RoleSwitch:
    """A worker's current role, the guard on the calls that take new work, and the switch."""

    def __init__(
        self,
        kind: str,
        decode: DecodeWorker,
        prefill: PrefillWorker,
        drain_timeout_s: float = 10.0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"a worker's role is one of {list(KINDS)}, got {kind!r}")
        if not drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {drain_timeout_s!r}")
        self.kind = kind
        self.decode, self.prefill = decode, prefill
        self.drain_timeout_s = drain_timeout_s
        self.presence: RolePresence | None = None  # set once the worker joined the registry
        self.switching = False
        self._lock = threading.Lock()
        self._inflight = dict.fromkeys(ADMITTING, 0)  # admitting calls running now

    def heartbeat(self, *args: Any, **kwargs: Any) -> RolePresence:
        """The worker's heartbeat (`Presence`'s arguments), not yet started; kept here, since a
        switch steps it aside and joins it again under the new kind."""
        self.presence = RolePresence(*args, **kwargs)
        return self.presence

    def guard(self, servicer: Any) -> RoleGuard:
        return RoleGuard(servicer, self)

    def admit(self, method: str) -> None:
        """Refuse a call that takes new work unless this role takes it (UNAVAILABLE: the
        gateway replaces a worker that refuses so)."""
        if self.switching or self.kind not in ADMITTING[method]:
            raise Unavailable(f"this worker is changing role to {self.kind} (no {method} here)")

    def enter(self, method: str) -> None:
        with self._lock:
            self._inflight[method] += 1

    def exit(self, method: str) -> None:
        with self._lock:
            self._inflight[method] -= 1

    def _busy(self, role: str) -> int:
        with self._lock:
            if role == "prefill":
                return self._inflight["Prefill"] + self.prefill.num_in_flight
            return self._inflight["Reserve"] + self.decode.num_in_flight

    async def switch_to(self, kind: str, drain_timeout_s: float = 0.0) -> SwitchResult:
        """Serve as `kind` from now on (see the module's doc); FailedPrecondition while another
        switch is under way."""
        if kind not in KINDS:
            raise InvalidRequest(f"kind must be one of {list(KINDS)}, got {kind!r}")
        previous = self.kind
        if kind == previous:
            return SwitchResult(kind, previous, 0.0, 0)
        with self._lock:
            if self.switching:
                raise FailedPrecondition("this worker is already changing role")
            self.switching = True
        started = time.monotonic()
        moved = 0
        try:
            presence = self.presence
            if presence is not None:
                await asyncio.to_thread(presence.step_aside)
            timeout_s = drain_timeout_s or self.drain_timeout_s
            if previous == "prefill":
                await self._drained("prefill", timeout_s)
            elif kind == "prefill":
                if not await self._drained("decode", timeout_s):
                    moved = await self.decode.move_streams(f"to {kind}; the stream moves elsewhere")
                    await self._drained("decode", timeout_s)
                await asyncio.to_thread(self.decode.prefix.leave)
            self.kind = kind
            if presence is not None:
                await asyncio.to_thread(presence.rejoin, kind)
        finally:
            self.switching = False
        seconds = time.monotonic() - started
        log.warning(
            "changed role %s -> %s in %.2f s (%d stream(s) moved)", previous, kind, seconds, moved
        )
        return SwitchResult(kind, previous, seconds, moved)

    async def _drained(self, role: str, timeout_s: float) -> bool:
        """Wait until `role`'s work in flight is done; False if `timeout_s` ran out first."""
        deadline = time.monotonic() + timeout_s
        while self._busy(role) > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True


class RolePresence(Presence):
    """A worker's presence that steps out of routing while it changes role (`step_aside`), and
    joins again under another kind."""

    def rejoin(self, kind: str) -> None:
        """Register under `kind` (its new role); heartbeats resume. A worker that can't serve
        just now (`info` raises `Stalled`) is left to the heartbeats, which join it once it
        can."""
        with self._lock:
            self._kind, self._left, self._aside = kind, False, False
            try:
                info = self.info()
            except Stalled:
                return
            self.registry.register_worker(info, self.ttl_s, self.kv_endpoint)
        self._rejoined.set()  # NOTE: on_rejoin (prefix index) runs on the housekeeping thread


class RoleGuard:
    """Stands in for a worker servicer: the calls that take new work pass `RoleSwitch.admit`
    first and are counted while they run; every other call goes straight through."""

    def __init__(self, target: Any, switch: RoleSwitch) -> None:
        self._target, self._switch = target, switch

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in ADMITTING or not inspect.iscoroutinefunction(attr):
            return attr
        return self._guarded(name, attr)

    def _guarded(self, name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        switch = self._switch

        async def call(request: Any, context: Any) -> Any:
            switch.admit(name)
            switch.enter(name)
            try:
                return await handler(request, context)
            finally:
                switch.exit(name)

        return call


class RoleServicer:
    """The `WorkerRole` service: SetRole and GetRole (internal calls, behind the cluster
    secret like the workers' others)."""

    def __init__(self, switch: RoleSwitch) -> None:
        self.switch = switch

    async def SetRole(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.SetRoleRequest, context: Any
    ) -> worker_pb2.RoleReply:
        if request.drain_timeout_s < 0:
            raise InvalidRequest(f"drain_timeout_s must be >= 0, got {request.drain_timeout_s}")
        result = await self.switch.switch_to(kind_from_wire(request.kind), request.drain_timeout_s)
        return worker_pb2.RoleReply(
            kind=kind_to_wire(result.kind),
            previous_kind=kind_to_wire(result.previous_kind),
            switch_seconds=result.seconds,
            num_streams_moved=result.num_streams_moved,
        )

    async def GetRole(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.GetRoleRequest, context: Any
    ) -> worker_pb2.RoleReply:
        kind = kind_to_wire(self.switch.kind)
        return worker_pb2.RoleReply(kind=kind, previous_kind=kind)
