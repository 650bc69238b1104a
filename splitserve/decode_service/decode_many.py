"""The decode worker's side of DecodeMany: many Decode streams over one call
(protos/v1/worker.proto; the gateway's side is gateway/decode_many.py).

Each started stream runs the Decode handler itself (`decode(request, context)`, the servicer's
method) in a task of its own, with a stand-in context that holds the stream's metadata and turns
`context.abort` into the stream's end. What the streams yield goes into one list; the call
sends the whole list as one message whenever it has any:

    engine step ─▶ front ─▶ stream tasks (one per request) ─▶ items ─▶ one DecodeBatch
                       └──▶ plain chunks, straight from the step's hand-off ──▶ items

A stream's plain chunks do not wake its task: the handler takes them where the front hands out
the step's outputs and puts them into the items at once (`StreamContext.direct_sink`,
decode_service/pace.py); its final message and its end go through the task. One step's tokens
of every stream go out as one message, not one per stream (the sender runs after the step's
hand-off); while a message is
written, the next ones gather, and a stream's new tokens join its tokens already waiting there
(one item per stream and sample, not one per step), as a Decode call of its own sends what
queued up during a write as one message: a gateway that reads slower than the engine steps gets
more tokens per item, not more items. A cancel (or the stream's own deadline, at the gateway)
cancels that stream's task, which aborts its request as a Decode call's cancel does; the call's
end cancels every stream on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from splitserve.engine.errors import InvalidRequest
from splitserve.protos.convert import join_delta
from splitserve.protos.v1 import common_pb2, worker_pb2
from splitserve.runtime.grpc_server import status_for

log = logging.getLogger(__name__)

# NOTE: `SPLITSERVE_DECODE_DIRECT=0` sends every chunk through its stream's task (to compare)
DIRECT = os.environ.get("SPLITSERVE_DECODE_DIRECT", "1") != "0"

Decode = Callable[[worker_pb2.DecodeRequest, Any], AsyncIterator[worker_pb2.DecodeResponse]]


class StreamEnded(Exception):
    """A stream's handler called `context.abort`: the stream ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: Any) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, tuple(trailers or ())


class StreamContext:
    """What a Decode handler asks of its call, for one stream of a DecodeMany call; the
    handler hands its plain chunks to `direct_sink` (decode_service/pace.py)."""

    def __init__(self, metadata: Any, direct_sink: Callable[[Any], None] | None) -> None:
        self._metadata = tuple(metadata.items())
        self.direct_sink = direct_sink

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        raise StreamEnded(code, details, trailing_metadata)


def _end(code: grpc.StatusCode, details: str, trailers: Any = ()) -> worker_pb2.DecodeEnd:
    return worker_pb2.DecodeEnd(
        code=code.value[0], details=details, trailers={k: str(v) for k, v in trailers}
    )


class DecodeMany:
    """One DecodeMany call: its streams, what they produced and not yet sent."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._items: list[worker_pb2.DecodeItem] = []
        # NOTE: per stream, its chunk item per sample in `_items`, which new tokens join
        self._open: dict[int, dict[int, worker_pb2.DecodeItem]] = {}
        self._ready = asyncio.Event()
        self._streams: dict[int, asyncio.Task[None]] = {}

    async def serve(
        self, controls: AsyncIterator[worker_pb2.DecodeControl]
    ) -> AsyncIterator[worker_pb2.DecodeBatch]:
        reader = asyncio.ensure_future(self._read(controls))
        try:
            while True:
                if not self._items:
                    if reader.done():
                        reader.result()  # NOTE: a bad control ends the call with its status
                        if not self._streams:
                            return  # NOTE: the caller closed its side and every stream ended
                    self._ready.clear()
                    await self._ready.wait()
                    continue
                items, self._items = self._items, []
                self._open.clear()
                yield worker_pb2.DecodeBatch(items=items)
        finally:
            reader.cancel()
            tasks = [reader, *self._streams.values()]
            for task in tasks:
                task.cancel()
            # NOTE: now, not when the GC finds them: each stream's cleanup aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)

    def _put(self, stream: int, msg: worker_pb2.DecodeResponse) -> None:
        """Queue `msg` of `stream` for the next message: a chunk joins the stream's chunk of
        the same sample already queued (tokens, text and logprobs in order)."""
        if msg.HasField("chunk"):
            self._put_chunk(stream, msg.chunk)
            return
        # NOTE: nothing may join a chunk queued before the stream's final message
        self._open.pop(stream, None)
        self._items.append(worker_pb2.DecodeItem(stream=stream, response=msg))
        self._ready.set()

    def _put_chunk(self, stream: int, chunk: common_pb2.SampleDelta) -> None:
        samples = self._open.setdefault(stream, {})
        queued = samples.get(chunk.index)
        if queued is not None:
            join_delta(queued.response.chunk, chunk)
            return
        response = worker_pb2.DecodeResponse(chunk=chunk)
        item = samples[chunk.index] = worker_pb2.DecodeItem(stream=stream, response=response)
        self._items.append(item)
        self._ready.set()

    def _sink(self, stream: int) -> Callable[[common_pb2.SampleDelta], None]:
        """Where `stream`'s handler puts a chunk from outside its task: dropped once the
        stream was cancelled (nobody reads it any more)."""

        def put(chunk: common_pb2.SampleDelta) -> None:
            if stream in self._streams:
                self._put_chunk(stream, chunk)

        return put

    def _put_end(self, stream: int, end: worker_pb2.DecodeEnd) -> None:
        self._open.pop(stream, None)
        self._items.append(worker_pb2.DecodeItem(stream=stream, end=end))
        self._ready.set()

    async def _read(self, controls: AsyncIterator[worker_pb2.DecodeControl]) -> None:
        try:
            async for control in controls:
                kind = control.WhichOneof("kind")
                if kind == "start":
                    start = control.start
                    if start.stream in self._streams:
                        raise InvalidRequest(f"stream {start.stream} is already started")
                    self._streams[start.stream] = asyncio.ensure_future(self._run(start))
                elif kind == "cancel":
                    running = self._streams.pop(control.cancel, None)
                    if running is not None:
                        running.cancel()
                else:
                    raise InvalidRequest("a DecodeControl starts or cancels a stream")
        finally:
            self._ready.set()  # NOTE: the sender checks whether the call is over

    async def _run(self, start: worker_pb2.DecodeStart) -> None:
        stream = start.stream
        put = self._put
        try:
            context = StreamContext(start.metadata, self._sink(stream) if DIRECT else None)
            async for msg in self._decode(start.request, context):
                put(stream, msg)
            end = worker_pb2.DecodeEnd()
        except StreamEnded as exc:
            end = _end(exc.code, exc.details, exc.trailers)
        except asyncio.CancelledError:
            self._streams.pop(stream, None)
            raise  # NOTE: cancelled by the caller, or the call ended: nobody to tell
        except Exception as exc:  # noqa: BLE001 - the stream's status, as a Decode call's
            code, details = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("Decode stream %d failed", stream, exc_info=exc)
            end = _end(code, details)
        self._streams.pop(stream, None)
        self._put_end(stream, end)
