"""`StreamReader` on a stream that joins what queued up (a DecodeMany stream of one sample):
a behind handler waits, then reads once (gateway/relay.py)."""

from __future__ import annotations

import asyncio

from splitserve.gateway.relay import StreamReader
from splitserve.gateway.requests import RequestTable
from tests.unit.relay_feeds import _chunk, _Feed, _run


class _JoiningFeed(_Feed):
    """A feed whose read returns every chunk queued since the last as one message, as a
    DecodeMany stream's does; `reads` counts the reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    async def stream(self):
        try:
            ended = False
            while not ended:
                item = await self.queue.get()
                self.reads += 1
                if item is None:
                    return
                while not self.queue.empty():
                    more = self.queue.get_nowait()
                    if more is None:
                        ended = True  # NOTE: after this read, as a stream's end comes
                        break
                    item.chunk.token_ids.extend(more.chunk.token_ids)
                yield item
        finally:
            self.closed = True


def test_a_behind_handler_on_a_joining_stream_waits_then_takes_what_came_in_one_read():
    async def main():
        feed = _JoiningFeed()
        claim = RequestTable().claim("r")
        # behind from its second take on; each hold lasts 50 ms
        reader = StreamReader(
            feed.stream(), claim, hold_after_s=0, min_hold_s=0.05, joins=True,
            joined_max_hold_s=0.05,
        )  # fmt: skip
        feed.send(_chunk(1))
        assert [list(m.chunk.token_ids) for m in await reader.take()] == [[1]]
        take = asyncio.ensure_future(reader.take())
        await asyncio.sleep(0.01)
        assert not take.done()  # holding: nothing read yet
        assert feed.reads == 1
        for i in (2, 3, 4):
            feed.send(_chunk(i))
        batch = await take
        assert [list(m.chunk.token_ids) for m in batch] == [[2, 3, 4]]
        assert feed.reads == 2 and reader._task is None  # one read, no task reading ahead
        feed.send(None)
        assert await reader.take() == []
        await reader.close()
        assert feed.closed

    _run(main())


def test_a_joining_stream_that_keeps_up_is_read_without_a_hold():
    async def main():
        feed = _JoiningFeed()
        reader = StreamReader(
            feed.stream(), RequestTable().claim("r"), hold_after_s=3600, min_hold_s=10,
            joins=True,
        )  # fmt: skip
        for i in (1, 2):
            feed.send(_chunk(i))
            started = asyncio.get_running_loop().time()
            assert [list(m.chunk.token_ids) for m in await reader.take()] == [[i]]
            assert asyncio.get_running_loop().time() - started < 1
        await reader.close()

    _run(main())


def test_an_abort_during_a_joining_streams_hold_ends_the_take():
    async def main():
        feed = _JoiningFeed()
        table = RequestTable()
        claim = table.claim("r")
        reader = StreamReader(
            feed.stream(), claim, hold_after_s=0, min_hold_s=0.05, joins=True,
            joined_max_hold_s=0.05,
        )  # fmt: skip
        feed.send(_chunk(1))
        assert len(await reader.take()) == 1
        feed.send(_chunk(2))
        take = asyncio.ensure_future(reader.take())
        await asyncio.sleep(0.01)
        assert table.abort("r")
        assert await take == []
        assert claim.aborted and feed.reads == 1  # the queued chunk was never read
        await reader.close()
        assert feed.closed

    _run(main())
