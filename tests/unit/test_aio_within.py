"""engine.aio.within: a bounded wait that never loses a cancel (asyncio.wait_for on Python 3.11
returns the result of a future that completes as its waiter is cancelled, and drops the cancel:
a cancelled Decode stream then ran on with nobody left to cancel it)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.aio import notified_within, within


def test_a_cancel_that_meets_the_answer_is_still_raised():
    async def main() -> None:
        fut = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(within(fut, 10.0))
        await asyncio.sleep(0)  # NOTE: the waiter now waits on fut
        fut.set_result(1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())


def test_the_answer_within_the_time_and_a_timeout_after_it():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_later(0.01, fut.set_result, 7)
        assert await within(fut, 5.0) == 7
        late = loop.create_future()
        with pytest.raises(asyncio.TimeoutError):
            await within(late, 0.01)
        assert late.cancelled()
        failing = loop.create_future()
        failing.set_exception(ValueError("no"))
        with pytest.raises(ValueError, match="no"):
            await within(failing, None)

    asyncio.run(main())


def test_a_cancelled_waiter_cancels_its_future():
    async def main() -> None:
        fut = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(within(fut, None))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert fut.cancelled()

    asyncio.run(main())


def test_notified_within_holds_the_lock_again_after_a_notify_a_timeout_and_a_cancel():
    async def main() -> None:
        cond = asyncio.Condition()
        async with cond:
            await notified_within(cond, 0.01)  # the timeout: no error
            assert cond.locked()

        async def waits() -> None:
            async with cond:
                await notified_within(cond, 10.0)
                assert cond.locked()

        task = asyncio.ensure_future(waits())
        await asyncio.sleep(0.01)
        async with cond:
            cond.notify_all()
        await asyncio.wait_for(task, 5)  # the notify ended it
        cancelled = asyncio.ensure_future(waits())
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert not cond.locked()  # released by the `async with` on the way out

    asyncio.run(main())


def test_notified_within_raises_a_cancel_that_meets_the_notify():
    async def main() -> None:
        cond = asyncio.Condition()
        woken: list[int] = []

        async def waits() -> None:
            async with cond:
                await notified_within(cond, 10.0)
                woken.append(1)

        task = asyncio.ensure_future(waits())
        await asyncio.sleep(0.01)
        async with cond:
            cond.notify_all()
        task.cancel()  # NOTE: in the same turn as the notify
        with pytest.raises(asyncio.CancelledError):
            await task
        assert woken == []
        assert not cond.locked()

    asyncio.run(main())
