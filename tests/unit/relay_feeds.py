"""The worker streams that the relay reader tests drive (gateway/relay.py `StreamReader`):
plain async generators whose messages a test releases."""

from __future__ import annotations

import asyncio

from splitserve.gateway.relay import StreamReader
from splitserve.protos.v1 import common_pb2, worker_pb2


def _delta(index: int, ids: list[int], logprobs: bool = False) -> common_pb2.SampleDelta:
    delta = common_pb2.SampleDelta(index=index, token_ids=ids, text="".join(f"<{i}>" for i in ids))
    if logprobs:
        for i in ids:
            delta.logprobs.add(token_id=i, logprob=-i / 10)
    return delta


class _Feed:
    """An async generator of DecodeResponses that yields each one only when `send` says."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.cancelled = False

    def send(self, item) -> None:
        self.queue.put_nowait(item)

    async def stream(self):
        try:
            while True:
                item = await self.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed = True


def _chunk(i: int) -> worker_pb2.DecodeResponse:
    return worker_pb2.DecodeResponse(chunk=_delta(0, [i]))


def _finished() -> worker_pb2.DecodeResponse:
    return worker_pb2.DecodeResponse(finished=worker_pb2.DecodeFinished())


async def _settle() -> None:
    """Let every ready task run until none has anything left to do now."""
    for _ in range(20):
        await asyncio.sleep(0)


def _run(coro):
    return asyncio.run(coro)


def _reading_ahead(feed: _Feed, claim, **kwargs) -> StreamReader:
    """A reader whose handler counts as behind from its second `take` on (a task then reads
    ahead) and never holds for more than the one message it waits for anyway."""
    kwargs = {"hold_after_s": 0, "hold_until": 1, **kwargs}
    return StreamReader(feed.stream(), claim, **kwargs)
