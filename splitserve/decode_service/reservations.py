"""Blocks a decode worker holds for prompts whose KV is still arriving: the transports' `Landing`.

A reservation lives from `Reserve` until `Decode` admits the request (or it is aborted, or its
lease in Redis expires because the prefill side died). A push is checked against it (request,
fence, blocks) before its blocks count as landed; a receiver that writes the blocks itself does
so under `hold`, which keeps the reservation from being reclaimed meanwhile (reclaiming takes
the same lock and marks it dead first, so no push lands in freed blocks). `Decode` waits on it
(`wait_complete_async`, on the server's event loop, holding no thread) until every needed block
has landed, or a push was refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from splitserve.engine.aio import within
from splitserve.engine.errors import Overloaded
from splitserve.kv_transfer.transport import PushRefused


@dataclass
class LocalReservation:
    request_id: str
    fence: int
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    block_size: int
    created: float = field(default_factory=time.monotonic)
    received: set[int] = field(default_factory=set)
    num_bytes: int = 0
    dead: bool = False
    refusal: str | None = None  # why a push for it was refused (it can't complete then)
    # What every push must carry (KVDestination.capability); b"": none asked (in-process use)
    capability: bytes = b""
    # The prompt (a front's own copy: its outputs are detokenized in its context)
    prompt_token_ids: tuple[int, ...] = ()
    # Leading tokens whose KV must land (None: every block's). A handed-off stream's is all
    # but its last token, whose block the sender may not have filled yet.
    num_kv_tokens: int | None = None
    # Per block of `block_ids`, its window slot (engine/window_slots.py; 0: none): a push
    # writes the sliding layers' KV of exactly the blocks with one. Empty: no window pool.
    window_slots: tuple[int, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)
    # Coroutines waiting in `wait_complete_async`: woken on their loops by `notify`.
    _async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def notify(self) -> None:
        """Wake every waiter, threads and coroutines (call with `changed` held)."""
        self.changed.notify_all()
        waiters, self._async_waiters = self._async_waiters, []
        for loop, future in waiters:
            # NOTE: a closed loop raises RuntimeError; nobody waits there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake, future)

    @property
    def needed(self) -> frozenset[int]:
        """Destination blocks a sender must fill: all but the cached prefix (and past
        `num_kv_tokens`, when set)."""
        end = len(self.block_ids)
        if self.num_kv_tokens is not None:
            end = min(end, -(-self.num_kv_tokens // self.block_size))
        return frozenset(self.block_ids[self.num_cached_tokens // self.block_size : end])

    @property
    def complete(self) -> bool:
        return self.needed <= self.received

    def progress(self) -> str:
        return f"{len(self.received & self.needed)} of {len(self.needed)} blocks"

    def wait_complete(self, timeout_s: float) -> bool:
        """Until every needed block landed (True), a push was refused or the reservation died
        (False), or `timeout_s` passed (False)."""
        with self.changed:
            self.changed.wait_for(
                lambda: self.complete or self.dead or self.refusal is not None, timeout_s
            )
            return self.complete and not self.dead and self.refusal is None

    async def wait_complete_async(self, timeout_s: float) -> bool:
        """`wait_complete` for a coroutine: the same answer, awaited on the running loop
        without holding a thread."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self.changed:
                if self.complete or self.dead or self.refusal is not None:
                    return self.complete and not self.dead and self.refusal is None
                future: asyncio.Future[None] = loop.create_future()
                self._async_waiters.append((loop, future))
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await within(future, remaining)
            except asyncio.TimeoutError:
                with self.changed:
                    return self.complete and not self.dead and self.refusal is None
            finally:
                with self.changed:
                    if (loop, future) in self._async_waiters:
                        self._async_waiters.remove((loop, future))


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class ReservationBook:
    """Thread-safe map of request id -> LocalReservation; the `Landing` of every transport."""

    def __init__(self, remember: int = 4096, per_caller: int = 0) -> None:
        self._items: dict[str, LocalReservation] = {}
        # Reservations (pending or held, not yet decoding) of each caller; at most `per_caller`
        # each (0: no limit), so that one caller can't hold the whole pool.
        self.per_caller = per_caller
        self._by_caller: dict[str, set[str]] = {}
        self._caller_of: dict[str, str] = {}
        # Recently removed ids, so a push that arrives late hears "reclaimed", not "unknown".
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._remember = remember
        self._lock = threading.Lock()

    def claim(self, request_id: str, caller: str) -> None:
        """Count a reservation being made for `caller` (before its blocks are taken); raise
        Overloaded (RESOURCE_EXHAUSTED) if the caller holds its limit already. `pop` or
        `unclaim` ends the count."""
        with self._lock:
            held = self._by_caller.setdefault(caller, set())
            if self.per_caller and len(held) >= self.per_caller and request_id not in held:
                raise Overloaded(
                    f"this caller holds {len(held)} reservations on this decode worker, its "
                    "limit (--max-reservations-per-caller); retry when one is decoding"
                )
            held.add(request_id)
            self._caller_of[request_id] = caller

    def unclaim(self, request_id: str) -> None:
        with self._lock:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        caller = self._caller_of.pop(request_id, None)
        if caller is None:
            return
        held = self._by_caller[caller]
        held.discard(request_id)
        if not held:
            del self._by_caller[caller]

    def add(self, reservation: LocalReservation) -> None:
        with self._lock:
            self._items[reservation.request_id] = reservation
            self._gone.pop(reservation.request_id, None)

    def get(self, request_id: str) -> LocalReservation | None:
        with self._lock:
            return self._items.get(request_id)

    def pop(self, request_id: str) -> LocalReservation | None:
        """Remove and return it, marked dead so that late pushes are refused."""
        with self._lock:
            reservation = self._items.pop(request_id, None)
            self._release(request_id)
            if reservation is not None:
                self._gone[request_id] = None
                while len(self._gone) > self._remember:
                    self._gone.popitem(last=False)
        if reservation is not None:
            with reservation.changed:
                reservation.dead = True
                reservation.notify()
        return reservation

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    # -- Landing ------------------------------------------------------------------------------

    def allowed_blocks(self, request_id: str, fence: int) -> frozenset[int]:
        res = self._live(request_id, fence)
        return res.needed

    def check_window(
        self,
        request_id: str,
        fence: int,
        dst_block_ids: Sequence[int],
        dst_window_slots: Sequence[int],
    ) -> None:
        res = self._live(request_id, fence)
        given = dict(zip(res.block_ids, res.window_slots, strict=False))
        expected = [given[b] for b in dst_block_ids if given.get(b)]
        if list(dst_window_slots) != expected:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"window slots {list(dst_window_slots)[:16]} are not those reserved for blocks "
                f"{list(dst_block_ids)[:16]} of {request_id!r} ({expected[:16]})",
            )

    def check_capability(self, request_id: str, capability: bytes) -> None:
        res = self.get(request_id)
        if res is not None and not hmac.compare_digest(res.capability, capability):
            raise PushRefused(
                "PERMISSION_DENIED",
                f"a push for {request_id!r} does not carry its reservation's capability",
            )

    def landed(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], num_bytes: int
    ) -> None:
        res = self._live(request_id, fence)
        with res.changed:
            self._check(res, fence, dst_block_ids)
            res.received.update(dst_block_ids)
            res.num_bytes += num_bytes
            res.notify()

    def refused(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], reason: str
    ) -> bool:
        res = self.get(request_id)
        if res is None:
            return False
        with res.changed:
            if fence < res.fence and not _overwrites(res, dst_block_ids):
                return False
            res.refusal = reason
            res.notify()
        return True

    @contextmanager
    def hold(
        self, request_id: str, fence: int, dst_block_ids: Sequence[int], num_bytes: int
    ) -> Iterator[None]:
        res = self._live(request_id, fence)
        with res.changed:
            self._check(res, fence, dst_block_ids)
            yield
            res.received.update(dst_block_ids)
            res.num_bytes += num_bytes
            res.notify()

    def _live(self, request_id: str, fence: int) -> LocalReservation:
        with self._lock:
            res = self._items.get(request_id)
            gone = request_id in self._gone
        if res is None and gone:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"the reservation of {request_id!r} was reclaimed or admitted already",
            )
        if res is None:
            raise PushRefused("NOT_FOUND", f"no reservation for request {request_id!r}")
        if fence != res.fence:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"stale fencing token {fence} for request {request_id!r} (it holds {res.fence})",
            )
        return res

    @staticmethod
    def _check(res: LocalReservation, fence: int, dst_block_ids: Sequence[int]) -> None:
        # NOTE: under the reservation's lock: a reclaimed (dead) reservation's blocks may already
        # belong to another request.
        if res.dead or fence != res.fence:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"reservation of {res.request_id!r} was reclaimed or replaced",
            )
        outside = sorted(set(dst_block_ids) - res.needed)
        if outside:
            raise PushRefused(
                "FAILED_PRECONDITION",
                f"blocks {outside[:16]} are not reserved for {res.request_id!r}",
            )


def _overwrites(res: LocalReservation, dst_block_ids: Sequence[int]) -> bool:
    """Whether a stale writer's bytes may lie over KV this reservation keeps: a block of it
    that has landed already or that nobody writes again (its cached prefix). A block still to
    land gets the live writer's bytes after the stale ones (call with `changed` held)."""
    kept = set(res.block_ids) - (res.needed - res.received)
    return not kept.isdisjoint(dst_block_ids)
