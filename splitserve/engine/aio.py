"""Small asyncio helpers shared by the async servicers and the engine's clients."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

T = TypeVar("T")


async def settled(future: asyncio.Future[Any]) -> bool:
    """Until `future` is done, whatever cancels the waiter meanwhile (its outcome is dropped):
    so that work running in a thread (on buffers, on the engine) is over before cleanup.
    Whether a cancel came meanwhile (for a caller that must still raise it)."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            cancelled = True
    if not future.cancelled():
        future.exception()  # NOTE: retrieved, so asyncio does not log it as never retrieved
    return cancelled


async def within(future: asyncio.Future[T], timeout_s: float | None) -> T:
    """`future`'s result, waiting at most `timeout_s` (then it is cancelled and
    asyncio.TimeoutError raised); a cancel of the waiter cancels it and is always raised. For
    futures whose cancel is immediate (a thread's or a process's answer, a plain future), not
    tasks that clean up when cancelled: nothing waits for that.

    NOTE: not `asyncio.wait_for`: on Python 3.11 and older it returns the result of a future
    that completes as the waiter is cancelled, and the cancel is lost, so a cancelled stream
    could go on running with nobody left to cancel it."""
    try:
        done, _ = await asyncio.wait([future], timeout=timeout_s)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done:
        future.cancel()
        raise asyncio.TimeoutError(f"no answer within {timeout_s} s")
    return future.result()


async def notified_within(condition: asyncio.Condition, timeout_s: float) -> None:
    """`condition.wait()` for at most `timeout_s` (no error at the timeout); the caller holds
    the condition's lock and holds it again when this returns or raises. A cancel is always
    raised (see `within`: `asyncio.wait_for` on 3.11 can drop one that meets the notify)."""
    waiter = asyncio.ensure_future(condition.wait())
    cancelled = False
    try:
        await asyncio.wait([waiter], timeout=timeout_s)
    except asyncio.CancelledError:
        cancelled = True
    if not waiter.done():
        waiter.cancel()
    # NOTE: the waiter takes the lock back whether notified or cancelled: wait for that
    cancelled = await settled(waiter) or cancelled
    if cancelled:
        raise asyncio.CancelledError()
    if not waiter.cancelled():
        waiter.result()  # NOTE: what the wait raised, if anything
