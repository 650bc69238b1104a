"""A Decode stream watched for silence: the gateway's side of telling a frozen decode worker
from a slow one (`migration.py` moves the stream when its worker is lost).

One watchdog task per stream, not a task or timer per message (the relay's cost is per token):
while a read is pending longer than the worker's paced deadline (`runtime/pace.py`), the
registry is asked whether the worker is still live, again every quarter of the deadline; a
worker that left it is lost, and the call is cancelled, which ends the pending read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from splitserve.protos.v1 import worker_pb2


class WorkerLost(Exception):
    """A decode stream's worker went silent and left the registry."""


async def watched(
    stream: Any,
    stall_s: Callable[[], float],
    is_live: Callable[[], Any],
    on_gap: Callable[[float], None] | None = None,
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """The messages of a Decode stream; raises WorkerLost when none arrives for `stall_s()`
    seconds (the worker's paced deadline, asked when due) and `is_live()` (awaited) says its
    worker has left the registry (asked again every quarter of it while the stream stays
    silent). A slow but live worker is waited for. `on_gap(seconds)` hears how long each
    message after the first was waited for (the first waits for admission and the prefill).

    NOTE: one watchdog task per stream, not a task or timer per message: the relay's cost is
    per token. It only counts time spent waiting for the worker (not while the consumer holds a
    message), and it cancels the call when the worker is gone, which ends the pending read."""
    waiting = [time.monotonic()]  # when the pending read began; empty while none is pending
    lost = [False]

    async def watchdog() -> None:
        while True:
            limit_s = stall_s()
            due = waiting[0] + limit_s - time.monotonic() if waiting else limit_s
            if due > 0:
                await asyncio.sleep(due)
                continue
            if not await is_live():
                lost[0] = True
                stream.cancel()
                return
            # NOTE: slow but live (or its record not yet lapsed): asked again while it is silent
            await asyncio.sleep(limit_s / 4)

    dog = asyncio.ensure_future(watchdog())
    first = True
    try:
        while True:
            try:
                msg = await stream.read()
            except (asyncio.CancelledError, grpc.RpcError):
                if lost[0]:
                    raise WorkerLost(f"no message for {stall_s():.1f} s and no heartbeat") from None
                raise
            if msg is grpc.aio.EOF:
                return
            if on_gap is not None and not first:
                on_gap(time.monotonic() - waiting[0])
            first = False
            waiting.clear()
            yield msg
            waiting.append(time.monotonic())
    finally:
        dog.cancel()
