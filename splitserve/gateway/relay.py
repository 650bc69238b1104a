"""Reading a request's worker stream ahead of its client writes, so that a stream that falls
behind sends what queued up as one client message.

Relaying costs the gateway per message (a gRPC write and its completion, docs/benchmarks.md
§14). When one message is read and written at a time, a saturated gateway leaves the worker's
tokens queued in gRPC's buffers and still pays one client write for each. Once a request's
handler falls behind, `StreamReader` reads its stream in a task of its own while the handler
writes; the handler takes everything that arrived meanwhile in one `take` and merges it
(`coalesce.merge_deltas`):

    worker:   [t1]    [t2] [t3] [t4]        [t5]   end
    reader:   t1 ─┐   t2   t3   t4 ─┐       t5 ─┐  end
    handler:      └ write [t1] ─────┴ write [t2 t3 t4] ┴ write [t5], finished

Behind means: the handler's previous message took `hold_after_s` or more between `take`s (a
write on an idle loop takes a fraction of that). Reading ahead alone does not make the queue
visible: gRPC hands over one message per read, and a read takes the event loop about as many
turns as a write, so a busy loop reads each stream exactly as fast as it writes it. So a handler
that is behind, and finds a message that came during its write, waits a little before it writes
again: for `hold_until` messages, the stream's end, or as long again as its previous message
took (at most `max_hold_s`), whichever comes first (none waiting: the worker is the slow
side, and it does not wait). Under load each write then carries several tokens, the loop spends
its turns on reads, and the tokens a stream gets per second go up; a message waits at most
`max_hold_s` longer than it would have.

A stream that joins what queued up for it into one message (`joins`: a DecodeMany stream of one
sample, gateway/decode_many.py) needs no reader task: a handler that is behind waits as long as
its previous message took (at most `joined_max_hold_s`), then reads once, and everything its
worker sent meanwhile comes as one message. A token then costs the gateway a list append, not
a task's wake-up through the stream's generators: the more loaded the loop, the longer each
message took, the more tokens the next one carries, so a saturated gateway sheds its load into
larger messages instead of falling further behind (docs/benchmarks.md §14). The hold never
exceeds what the previous message already took.

At light load nothing changes: until a handler first falls behind it reads its stream itself,
as before (no task, no wait, one token a message), and its first message never waits. Then
one task per request, not per message, and one timer per held `take`. The reader stays at most
`max_pending` messages ahead of the handler, so a client that stops reading still holds its
worker back through gRPC's flow control rather than the gateway's memory.

A time gate (`min_gap_s`, the request's `stream_interval_ms`) holds every `take` after the
first until that long has passed since the previous one returned, or the stream ends: whatever
arrived meanwhile goes out as one message, so a stream gets at most one message per gap however
fast its tokens come (a gated reader reads ahead from its second message on, and keeps up to
`GATED_MAX_PENDING` messages, so a fast stream never waits on the gate's buffer).

Aborts land where they did: `Claim.abort` cancels the task that waits on the workers (the
handler's, or the reader's once there is one), and the orchestrator frees what the request
holds.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncGenerator

from splitserve.gateway.requests import Claim
from splitserve.protos.v1 import worker_pb2

# Messages read ahead of the handler at most: past this the reader waits for a `take`.
MAX_PENDING = 64
# A handler whose previous message took this long or longer is behind (its loop is busy)...
# (`SPLITSERVE_RELAY_MERGE=0`: never, so one worker message is one client message, and a
# DecodeMany stream's reader takes its messages one at a time: gateway/decode_many.py; to compare)
MERGE_ENV = "SPLITSERVE_RELAY_MERGE"
MERGE = os.environ.get(MERGE_ENV, "1") != "0"
HOLD_AFTER_S = 0.001 if MERGE else math.inf
# ...and waits for this many messages to write as one...
HOLD_UNTIL = 8
# ...or as long again as that message took, but no longer than this.
MAX_HOLD_S = 0.005
# Messages a time-gated reader keeps at most (past this the gate opens early).
GATED_MAX_PENDING = 1024
# A joining stream's handler that is behind waits at most this long before it reads (see the
# module doc): longer than a decode step, so that a saturated gateway's messages carry several
JOINED_MAX_HOLD_S = 0.05


class StreamReader:
    """The orchestrator's stream for one request, read ahead by a task of its own."""

    def __init__(
        self,
        responses: AsyncGenerator[worker_pb2.DecodeResponse, None],
        claim: Claim,
        max_pending: int = MAX_PENDING,
        hold_after_s: float = HOLD_AFTER_S,
        hold_until: int = HOLD_UNTIL,
        max_hold_s: float = MAX_HOLD_S,
        min_hold_s: float = 0.0,
        min_gap_s: float = 0.0,
        joins: bool = False,
        joined_max_hold_s: float = JOINED_MAX_HOLD_S,
    ) -> None:
        """`hold_*`, `max_hold_s`: see the module doc; a hold lasts `min_hold_s` at least;
        `min_gap_s`: the time gate (0: none); `joins`: one read of `responses` returns what
        queued up (no reader task; a hold of `joined_max_hold_s` at most)."""
        self._responses = responses
        self._claim = claim
        self._min_gap_s = min_gap_s
        self._joins = joins and MERGE
        self._joined_max_hold_s = joined_max_hold_s
        self._max_pending = max(max_pending, GATED_MAX_PENDING) if min_gap_s > 0 else max_pending
        self._hold_after_s = hold_after_s
        self._hold_until = min(hold_until, max_pending)
        self._max_hold_s = max_hold_s
        self._min_hold_s = min_hold_s
        self._pending: list[worker_pb2.DecodeResponse] = []
        self._error: BaseException | None = None
        self._returned_at: float | None = None  # when `take` last handed out messages
        # NOTE: at most one of the two waits at a time: the handler for a message, the reader
        # for room; whoever changes `_pending` wakes the other.
        self._wake_handler: asyncio.Future[None] | None = None
        self._wake_reader: asyncio.Future[None] | None = None
        # NOTE: None until the handler first falls behind: until then `take` reads itself
        self._task: asyncio.Task[None] | None = None
        self._ended = False  # a `take` that read itself saw the stream end
        # NOTE: asked once: `asyncio.get_running_loop()` costs a getpid() call each time
        self._loop: asyncio.AbstractEventLoop | None = None

    async def take(self) -> list[worker_pb2.DecodeResponse]:
        """Every message read since the last call, in order, waiting for one if there is none
        (and, when the handler is behind, a little longer: see the module doc); [] once the
        stream ended (its end, or an abort); the stream's error after its last message."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if self._min_gap_s > 0 and self._returned_at is not None:
            return await self._take_gated(loop)
        busy_s = loop.time() - self._returned_at if self._returned_at is not None else 0.0
        behind = self._returned_at is not None and busy_s >= self._hold_after_s
        if self._task is None:
            if self._ended or not behind:
                return await self._read_one(loop)
            if self._joins:
                hold_s = min(max(busy_s, self._min_hold_s), self._joined_max_hold_s)
                await _sleep(loop, hold_s)
                return await self._read_one(loop)
            self._task = asyncio.ensure_future(self._read())
        # NOTE: only with a message already waiting: one that came during the write shows a
        # backlog; none means the worker is the slow side, and waiting would only add latency
        if behind and 0 < len(self._pending) < self._hold_until:
            hold_s = min(max(busy_s, self._min_hold_s), self._max_hold_s)
            await self._hold(loop, hold_s, self._hold_until)
        return await self._handed_out(loop)

    async def _take_gated(self, loop: asyncio.AbstractEventLoop) -> list[worker_pb2.DecodeResponse]:
        """`take` with the time gate, after the first message (see the module doc)."""
        assert self._returned_at is not None
        if self._task is None:
            if self._ended:
                return []
            self._task = asyncio.ensure_future(self._read())
        wait_s = self._returned_at + self._min_gap_s - loop.time()
        if wait_s > 0:
            await self._hold(loop, wait_s, self._max_pending)
        return await self._handed_out(loop)

    async def _handed_out(self, loop: asyncio.AbstractEventLoop) -> list[worker_pb2.DecodeResponse]:
        """What is pending (waiting for a message if none is); [] or the error at the end."""
        assert self._task is not None
        while not self._pending and not self._task.done():
            await self._wait_for_reader(loop)
        if self._pending:
            taken, self._pending = self._pending, []
            _wake(self._wake_reader)
            self._returned_at = loop.time()
            return taken
        if self._error is not None:
            raise self._error
        return []

    async def _read_one(self, loop: asyncio.AbstractEventLoop) -> list[worker_pb2.DecodeResponse]:
        """The next message, read by the handler itself (it is not behind: no task reads
        ahead yet); [] at the end."""
        if self._ended:
            return []
        claim = self._claim
        if claim.aborted:
            return []
        # NOTE: the task that waits on the workers now (the HTTP API may change it)
        claim.task, claim.waiting = asyncio.current_task(loop), True
        try:
            msg = await anext(self._responses)
        except StopAsyncIteration:
            self._ended = True
            return []
        except asyncio.CancelledError:
            if not claim.absorb_cancel():
                raise
            self._ended = True
            return []  # NOTE: aborted; the orchestrator has freed what it held
        except BaseException:
            self._ended = True
            raise
        finally:
            claim.waiting = False
        self._returned_at = loop.time()
        return [msg]

    async def _hold(self, loop: asyncio.AbstractEventLoop, hold_s: float, until: int) -> None:
        """Until `until` messages are pending, the stream ends, or `hold_s` passed."""
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            _wake(self._wake_handler)

        timer = loop.call_later(hold_s, expire)
        assert self._task is not None
        try:
            while len(self._pending) < until and not self._task.done():
                if expired:
                    return
                await self._wait_for_reader(loop)
        finally:
            timer.cancel()

    async def _wait_for_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake_handler = loop.create_future()
        try:
            await self._wake_handler
        finally:
            self._wake_handler = None

    async def close(self) -> None:
        """Stop reading and close the stream: once this returns, what the request held on the
        workers is freed (the orchestrator's clean-up ran). Safe to call more than once."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            # NOTE: not `await self._task`: its CancelledError is not ours to raise (we may not
            # be cancelled), and the orchestrator shields its own clean-up from a second cancel.
            await asyncio.wait([self._task])
        await self._responses.aclose()

    async def _read(self) -> None:
        claim, responses = self._claim, self._responses
        # NOTE: the claim's task is the one that waits on the workers: Abort cancels it there
        claim.task = asyncio.current_task()
        try:
            while not claim.aborted:
                claim.waiting = True
                try:
                    msg = await anext(responses)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not claim.absorb_cancel():
                        raise
                    return  # NOTE: aborted; the orchestrator has freed what it held
                finally:
                    claim.waiting = False
                self._pending.append(msg)
                _wake(self._wake_handler)
                while len(self._pending) >= self._max_pending and not claim.aborted:
                    self._wake_reader = asyncio.get_running_loop().create_future()
                    try:
                        await self._wake_reader
                    finally:
                        self._wake_reader = None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # NOTE: handed to the handler after its last message
            self._error = exc
        finally:
            _wake(self._wake_handler)


async def _sleep(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """`asyncio.sleep` on a loop already known (it asks for the running loop each time)."""
    waiter = loop.create_future()
    timer = loop.call_later(seconds, _wake, waiter)
    try:
        await waiter
    finally:
        timer.cancel()


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
