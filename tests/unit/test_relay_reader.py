"""Reading a worker stream ahead of the client writes, holds and time gates
(gateway/relay.py `StreamReader`)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.gateway.relay import StreamReader
from splitserve.gateway.requests import RequestTable
from tests.unit.relay_feeds import _chunk, _Feed, _finished, _reading_ahead, _run, _settle


def test_a_handler_that_keeps_up_reads_one_message_at_a_time_itself():
    async def main():
        feed = _Feed()
        reader = StreamReader(feed.stream(), RequestTable().claim("r"), hold_after_s=3600)
        for i in (1, 2, 3):
            feed.send(_chunk(i))
        feed.send(None)
        batches = [[m.chunk.token_ids[0] for m in await reader.take()] for _ in range(4)]
        assert batches == [[1], [2], [3], []]
        await reader.close()
        assert feed.closed

    _run(main())


def test_messages_that_arrive_while_the_handler_is_busy_come_in_one_take():
    async def main():
        feed = _Feed()
        claim = RequestTable().claim("r")
        reader = _reading_ahead(feed, claim)
        feed.send(_chunk(1))
        assert [m.chunk.token_ids[0] for m in await reader.take()] == [1]
        for i in (2, 3, 4):  # the handler is "writing": the reader reads on
            feed.send(_chunk(i))
        await _settle()
        assert [m.chunk.token_ids[0] for m in await reader.take()] == [2, 3, 4]
        feed.send(_chunk(5))
        feed.send(_finished())
        feed.send(None)
        await _settle()
        batch = await reader.take()
        assert [m.HasField("finished") for m in batch] == [False, True]
        assert await reader.take() == []
        await reader.close()
        assert feed.closed

    _run(main())


def test_a_stream_error_comes_after_the_messages_read_before_it():
    async def main():
        feed = _Feed()
        reader = _reading_ahead(feed, RequestTable().claim("r"))
        feed.send(_chunk(0))
        assert len(await reader.take()) == 1
        feed.send(_chunk(1))
        feed.send(RuntimeError("worker lost"))
        await _settle()
        assert len(await reader.take()) == 1
        with pytest.raises(RuntimeError, match="worker lost"):
            await reader.take()
        await reader.close()

    _run(main())


def test_an_abort_while_the_reader_waits_cancels_the_stream_and_ends_the_takes():
    async def main():
        feed = _Feed()
        table = RequestTable()
        claim = table.claim("r")
        reader = _reading_ahead(feed, claim)
        feed.send(_chunk(0))
        assert len(await reader.take()) == 1
        feed.send(_chunk(1))
        assert len(await reader.take()) == 1  # the reader task runs from here on
        await _settle()
        assert claim.waiting  # the reader waits on the worker: that is where the abort lands
        assert table.abort("r")
        assert await reader.take() == []
        assert feed.cancelled and claim.aborted
        await reader.close()

    _run(main())


def test_a_full_buffer_holds_the_reader_back_until_the_handler_takes():
    async def main():
        feed = _Feed()
        reader = _reading_ahead(feed, RequestTable().claim("r"), max_pending=3)
        feed.send(_chunk(0))
        assert len(await reader.take()) == 1
        for i in range(5):
            feed.send(_chunk(i))
        assert len(await reader.take()) == 3  # a reader task starts: three read, then it waits
        await _settle()
        assert feed.queue.qsize() == 0  # room again: the last two read
        assert len(await reader.take()) == 2
        for i in range(5):
            feed.send(_chunk(i))
        await _settle()
        assert feed.queue.qsize() == 2  # three read, two left with the worker
        assert len(await reader.take()) == 3
        await _settle()
        assert len(await reader.take()) == 2
        await reader.close()

    _run(main())


def test_closing_mid_stream_cancels_the_read_and_closes_the_stream():
    async def main():
        feed = _Feed()
        reader = _reading_ahead(feed, RequestTable().claim("r"))
        feed.send(_chunk(0))
        assert len(await reader.take()) == 1
        feed.send(_chunk(1))
        assert len(await reader.take()) == 1
        await _settle()  # the reader task waits on the worker now
        await reader.close()
        assert feed.cancelled and feed.closed
        await reader.close()  # a second close is harmless

    _run(main())


def test_a_handler_that_is_behind_waits_for_more_messages_to_write_as_one():
    async def main():
        feed = _Feed()
        # hold_after_s=0: every take after the first counts as behind; no time limit in sight
        reader = StreamReader(
            feed.stream(), RequestTable().claim("r"), hold_after_s=0, hold_until=3,
            min_hold_s=3600, max_hold_s=3600,
        )  # fmt: skip
        feed.send(_chunk(0))
        assert len(await reader.take()) == 1  # the first message never waits
        feed.send(_chunk(1))
        assert len(await reader.take()) == 1  # behind, nothing waiting: a reader task starts
        feed.send(_chunk(2))
        await _settle()
        held = asyncio.ensure_future(reader.take())
        await _settle()
        assert not held.done()  # behind, one message waiting: it waits for more
        feed.send(_chunk(3))
        feed.send(_chunk(4))
        await _settle()
        assert [m.chunk.token_ids[0] for m in await held] == [2, 3, 4]
        feed.send(_chunk(5))
        feed.send(None)  # the stream's end releases a held take with what it has
        assert [m.chunk.token_ids[0] for m in await reader.take()] == [5]
        assert await reader.take() == []
        await reader.close()

    _run(main())


def test_a_held_take_waits_no_longer_than_its_limit():
    async def main():
        feed = _Feed()
        reader = StreamReader(
            feed.stream(), RequestTable().claim("r"), hold_after_s=0, hold_until=8, max_hold_s=0
        )
        feed.send(_chunk(0))
        await reader.take()
        feed.send(_chunk(1))
        await reader.take()
        feed.send(_chunk(2))
        await _settle()
        batch = await asyncio.wait_for(reader.take(), 30)  # the limit, not the stream, ends it
        assert [m.chunk.token_ids[0] for m in batch] == [2]
        await reader.close()
        assert feed.cancelled

    _run(main())


def test_a_time_gate_sends_what_came_within_the_gap_as_one_take_and_never_holds_the_end():
    """`min_gap_s` (a request's stream_interval_ms): the first message goes at once; each later
    take returns no sooner than the gap after the previous one, with everything that came
    meanwhile; the stream's end opens the gate at once."""

    async def main():
        loop = asyncio.get_running_loop()
        feed = _Feed()
        gap_s = 0.2
        reader = StreamReader(feed.stream(), RequestTable().claim("r"), min_gap_s=gap_s)
        feed.send(_chunk(0))
        start = loop.time()
        assert [m.chunk.token_ids[0] for m in await reader.take()] == [0]
        assert loop.time() - start < gap_s  # the first message is not held

        async def produce() -> None:  # a token every 20 ms: ten within one gap
            for i in range(1, 21):
                await asyncio.sleep(0.02)
                feed.send(_chunk(i))
            feed.send(_finished())
            feed.send(None)

        producer = asyncio.ensure_future(produce())
        taken, times = [], []
        last = loop.time()
        while batch := await reader.take():
            now = loop.time()
            times.append(now - last)
            last = now
            taken.append(batch)
        await producer
        ids = [m.chunk.token_ids[0] for b in taken for m in b if m.HasField("chunk")]
        assert ids == list(range(1, 21))
        assert taken[-1][-1].HasField("finished")
        assert len(taken) < 20 / 2  # several tokens a take, not one
        # NOTE: a lower bound only: each take waited for the gap since the one before it
        assert all(t >= gap_s * 0.99 for t in times[:-1]), times
        await reader.close()
        assert feed.closed

    _run(main())


def test_a_time_gate_keeps_a_fast_stream_in_one_take_however_many_messages_came():
    async def main():
        feed = _Feed()
        reader = StreamReader(feed.stream(), RequestTable().claim("r"), min_gap_s=0.05)
        feed.send(_chunk(0))
        await reader.take()
        for i in range(1, 201):  # past the reader's usual buffer of 64
            feed.send(_chunk(i))
        feed.send(None)
        batch = await reader.take()
        assert [m.chunk.token_ids[0] for m in batch] == list(range(1, 201))
        assert await reader.take() == []
        await reader.close()

    _run(main())


def test_an_abort_during_a_time_gate_ends_the_take():
    async def main():
        feed = _Feed()
        table = RequestTable()
        claim = table.claim("r")
        reader = StreamReader(feed.stream(), claim, min_gap_s=3600)
        feed.send(_chunk(0))
        await reader.take()
        held = asyncio.ensure_future(reader.take())
        await _settle()
        assert not held.done()
        assert table.abort("r")
        assert await asyncio.wait_for(held, 30) == []
        assert feed.cancelled
        await reader.close()

    _run(main())
