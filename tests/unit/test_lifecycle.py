"""A service's gated servicers: UNAVAILABLE "loading" until bound, admission refused while
draining (other calls go on), and calls in flight (async streams included) counted for the
drain. Forwarded calls are what the asyncio server runs: coroutines and async generators."""

from __future__ import annotations

import asyncio
import threading

import pytest

from splitserve.engine.errors import Unavailable
from splitserve.runtime.lifecycle import Lifecycle, State


class Worker:
    async def Reserve(self, request, context):
        await asyncio.sleep(0)
        return f"reserved {request}"

    async def Decode(self, request, context):
        for i in range(request):
            await asyncio.sleep(0)
            yield i


class SyncWorker:
    def Reserve(self, request, context):
        return f"reserved {request}"

    def Decode(self, request, context):
        yield from range(request)


async def collect(stream) -> list:
    return [item async for item in stream]


@pytest.mark.parametrize("worker", [Worker, SyncWorker])
def test_methods_answer_unavailable_loading_until_the_servicer_is_bound(worker):
    lifecycle = Lifecycle(["svc"])
    gate = lifecycle.gate(admitting=["Reserve"])
    with pytest.raises(Unavailable, match="^loading$"):
        gate.Reserve("r", None)
    with pytest.raises(Unavailable, match="^loading$"):
        gate.Decode(3, None)
    gate.bind(worker())
    lifecycle.set_serving()
    assert asyncio.run(gate.Reserve("r", None)) == "reserved r"
    assert asyncio.run(collect(gate.Decode(3, None))) == [0, 1, 2]
    assert lifecycle.num_busy() == 0


def test_draining_refuses_new_work_but_lets_running_streams_finish():
    lifecycle = Lifecycle(["svc"])
    gate = lifecycle.gate(admitting=["Reserve"])
    gate.bind(Worker())
    lifecycle.set_serving()

    async def scenario() -> None:
        stream = gate.Decode(3, None)
        assert await anext(stream) == 0
        assert lifecycle.num_busy() == 1
        lifecycle.start_draining()
        assert lifecycle.state is State.DRAINING
        with pytest.raises(Unavailable, match="draining"):
            await gate.Reserve("late", None)
        assert not lifecycle.wait_idle(0.1)
        assert await collect(stream) == [1, 2]  # the running call is not cut
        assert lifecycle.num_busy() == 0 and lifecycle.wait_idle(0.1)

    asyncio.run(scenario())


class Slow:
    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Reserve(self, request, context):
        await self.release.wait()
        return request


def test_a_unary_call_counts_while_it_awaits():
    lifecycle = Lifecycle(["svc"])
    gate = lifecycle.gate()

    async def scenario() -> None:
        slow = Slow()
        gate.bind(slow)
        call = asyncio.ensure_future(gate.Reserve("r", None))
        await asyncio.sleep(0.01)
        assert lifecycle.num_busy() == 1
        slow.release.set()
        assert await call == "r"
        assert lifecycle.num_busy() == 0

    asyncio.run(scenario())


def test_a_stream_closed_early_or_cancelled_stops_counting():
    lifecycle = Lifecycle(["svc"])
    gate = lifecycle.gate()
    gate.bind(Worker())

    async def scenario() -> None:
        stream = gate.Decode(100, None)
        assert await anext(stream) == 0
        assert lifecycle.num_busy() == 1
        await stream.aclose()  # the caller went away
        assert lifecycle.num_busy() == 0

        async def consume() -> None:  # as the server does: the stream is closed at the end
            stream = gate.Decode(10**9, None)
            try:
                async for _ in stream:
                    await asyncio.sleep(0.001)
            finally:
                await stream.aclose()

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.02)
        assert lifecycle.num_busy() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lifecycle.num_busy() == 0

    asyncio.run(scenario())


def test_drain_also_waits_for_registered_pending_work_or_an_interrupt():
    lifecycle = Lifecycle(["svc"])
    pending = [1]
    lifecycle.also_wait_for(lambda: len(pending))
    interrupt = threading.Event()
    threading.Timer(0.1, interrupt.set).start()
    assert not lifecycle.wait_idle(30, interrupt)
    pending.clear()
    assert lifecycle.wait_idle(0.1)
