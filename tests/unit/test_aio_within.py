"""engine.aio.within: a bounded wait that never loses a cancel (asyncio.wait_for on Python 3.11
returns the result of a future that completes as its waiter is cancelled, and drops the cancel:
a cancelled Decode stream then ran on with nobody left to cancel it)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.aio import within


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
