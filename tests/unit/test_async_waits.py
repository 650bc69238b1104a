"""What the asyncio servers wait on, without holding a thread or blocking their loop: engine
calls (`EngineLoop.call_async`), a request's outputs (`subscribe_async`, fed from the engine
thread) and KV landing on a reservation (`wait_complete_async`, woken from transport threads).
The engine here is a stand-in that steps on the real `EngineLoop` thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.engine.engine_loop import EngineLoop, EngineStopped
from splitserve.engine.outputs import CompletionOutput, RequestOutput


class FakeConnector:
    def fail_all(self, exc: BaseException) -> None:
        pass


class FakePlatform:
    def activate(self) -> None:
        """A CPU engine has no GPU to make current."""


class FakeEngine:
    """Emits one output per step for each request in `running`, finishing after `steps`."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.running: dict[str, int] = {}
        self.kv_connector = FakeConnector()
        self.platform = FakePlatform()
        self.fail_next_step = False

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def num_running_seqs(self) -> int:
        return len(self.running)

    def housekeeping(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            raise RuntimeError("step failed")
        time.sleep(0.005)
        outputs = []
        for request_id in list(self.running):
            self.running[request_id] += 1
            done = self.running[request_id] >= self.steps
            tokens = list(range(self.running[request_id]))
            outputs.append(
                RequestOutput(
                    request_id, None, [1], [CompletionOutput(0, "", tokens)], finished=done
                )
            )
            if done:
                del self.running[request_id]
        return outputs

    def add(self, request_id: str) -> str:
        self.running[request_id] = 0
        return request_id


@pytest.fixture
def loop_and_engine():
    engine = FakeEngine()
    loop = EngineLoop(engine, idle_wait_s=0.01).start()  # type: ignore[arg-type]
    yield loop, engine
    loop.stop()


def test_call_async_returns_the_result_or_raises_the_error_of_the_engine_thread(loop_and_engine):
    loop, _ = loop_and_engine

    def fails(engine: FakeEngine) -> None:
        raise ValueError("bad command")

    async def scenario() -> None:
        assert await loop.call_async(lambda e: threading.current_thread().name) == "engine-loop"
        with pytest.raises(ValueError, match="bad command"):
            await loop.call_async(fails)

    asyncio.run(scenario())


def test_many_requests_stream_outputs_on_one_loop_while_it_stays_responsive(loop_and_engine):
    loop, _ = loop_and_engine

    async def one(request_id: str) -> list[int]:
        outputs = loop.subscribe_async(request_id, asyncio.get_running_loop())
        try:
            await loop.call_async(lambda e: e.add(request_id))
            seen = []
            while True:
                item = await outputs.get()
                assert isinstance(item, RequestOutput)
                seen.append(len(item.outputs[0].token_ids))
                if item.finished:
                    return seen
        finally:
            loop.unsubscribe(request_id)

    async def ticker(stop: asyncio.Event) -> int:
        ticks = 0
        while not stop.is_set():
            await asyncio.sleep(0.001)
            ticks += 1
        return ticks

    async def scenario() -> None:
        stop = asyncio.Event()
        ticks = asyncio.ensure_future(ticker(stop))
        results = await asyncio.gather(*(one(f"r{i}") for i in range(300)))
        stop.set()
        assert all(seen == [1, 2, 3] for seen in results)
        assert await ticks > 5, "the loop was blocked while requests waited"

    asyncio.run(scenario())


def test_a_failed_engine_reaches_every_async_subscriber_and_later_calls(loop_and_engine):
    loop, engine = loop_and_engine

    async def scenario() -> None:
        outputs = loop.subscribe_async("r", asyncio.get_running_loop())
        engine.steps = 10**6
        await loop.call_async(lambda e: e.add("r"))
        assert isinstance(await outputs.get(), RequestOutput)
        engine.fail_next_step = True
        while isinstance(item := await outputs.get(), RequestOutput):
            pass
        assert isinstance(item, EngineStopped) and "step failed" in str(item)
        with pytest.raises(EngineStopped):
            await loop.call_async(lambda e: None)

    asyncio.run(scenario())


def _reservation() -> LocalReservation:
    return LocalReservation("req", fence=1, block_ids=(4, 5), num_cached_tokens=0, block_size=16)


def test_wait_complete_async_wakes_when_the_last_block_lands_from_another_thread():
    book = ReservationBook()
    res = _reservation()
    book.add(res)

    async def scenario() -> bool:
        waiting = asyncio.ensure_future(res.wait_complete_async(10))
        await asyncio.sleep(0.02)
        threading.Thread(target=book.landed, args=("req", 1, [4], 10)).start()
        await asyncio.sleep(0.05)
        assert not waiting.done()
        threading.Thread(target=book.landed, args=("req", 1, [5], 10)).start()
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(scenario()) is True
    assert res.complete and not res._async_waiters


@pytest.mark.parametrize("ending", ["refused", "reclaimed"])
def test_wait_complete_async_answers_false_once_a_push_is_refused_or_it_is_reclaimed(ending):
    book = ReservationBook()
    res = _reservation()
    book.add(res)

    def end() -> None:
        if ending == "refused":
            book.refused("req", res.fence, [5], "bad checksum")
        else:
            book.pop("req")

    async def scenario() -> bool:
        waiting = asyncio.ensure_future(res.wait_complete_async(10))
        await asyncio.sleep(0.02)
        threading.Thread(target=end).start()
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(scenario()) is False


def test_wait_complete_async_times_out_with_false():
    res = _reservation()
    started = time.monotonic()
    assert asyncio.run(res.wait_complete_async(0.1)) is False
    assert 0.09 < time.monotonic() - started < 2
    assert not res._async_waiters
