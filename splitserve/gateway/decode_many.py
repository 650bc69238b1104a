"""Many Decode streams over one call per decode worker (`DecodeMany`, protos/v1/worker.proto).

A gateway process relays every token twice, a read from its worker and a write to its client,
and each costs about the same (gRPC's C core and its completion, docs/benchmarks.md §14). With a
call per stream, a decode worker's step of N streams is N messages to read. Here a gateway
process keeps one DecodeMany call per decode worker; streams start and cancel on it, and the
worker sends one message per step carrying every stream's new messages:

    stream 1 ─┐  start / cancel                      ┌─ items of stream 1 ─▶ MuxStream 1 ─▶ relay
    stream 2 ─┼──────────────▶ DecodeMany call ──────┼─ items of stream 2 ─▶ MuxStream 2 ─▶ relay
    stream 3 ─┘                (one per worker)      └─ ...                 (one reader task)

`MuxStream` answers what the orchestrator asks of a Decode call (`read`, `cancel`, a deadline,
errors as `grpc.aio.AioRpcError` with the stream's own code, details and trailers), so failover,
the stall watchdog and the relay above it do not change. A stream's error ends that stream only;
the call's end (its worker died, or stopped) ends every stream on it with the call's status, and
the next stream opens a new call. A worker without DecodeMany (an earlier version, during an
upgrade) answers UNIMPLEMENTED: its streams then go out as Decode calls of their own.

A stream whose reader falls behind takes what queued up for it as one message (its chunks of one
sample joined), so the relay above pays per message it reads, not per step it missed.

Reading never waits on a stream's consumer: the one reader task hands each item to its stream's
queue, so a client that stops reading does not hold back the others (its queue is bounded by its
request's `max_tokens`), where a call per stream held its worker back through flow control.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
from typing import Any

import grpc

from splitserve.gateway.relay import MERGE
from splitserve.protos.convert import join_delta
from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


def _error(code: grpc.StatusCode, details: str, trailers: Any = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=details
    )


_STATUS = {status.value[0]: status for status in grpc.StatusCode}


def _joined(messages: collections.deque[worker_pb2.DecodeResponse]) -> worker_pb2.DecodeResponse:
    """The first of `messages` (taken off), with the chunks of the same sample right behind it
    joined into it: what a stream's reader had not taken yet goes on as one message, as a
    worker that sends what queued up during a write does."""
    first = messages.popleft()
    if not messages or not first.HasField("chunk"):
        return first
    chunk = first.chunk
    while messages and messages[0].HasField("chunk") and messages[0].chunk.index == chunk.index:
        join_delta(chunk, messages.popleft().chunk)
    return first


class MuxStream:
    """One Decode stream on a DecodeMany call, read as a Decode call is read."""

    def __init__(
        self,
        mux: DecodeMux,
        stream: int,
        request: worker_pb2.DecodeRequest,
        timeout: float | None,
        metadata: Any,
    ) -> None:
        self._mux = mux
        self._stream = stream
        self._request, self._metadata = request, metadata
        self._plain: Any = None  # a Decode call of its own, once the worker refused DecodeMany
        self._messages: collections.deque[worker_pb2.DecodeResponse] = collections.deque()
        self._end: grpc.aio.AioRpcError | None = None
        self._ended = False  # its end came (`_end` None: OK)
        self._cancelled = False
        self._waiter: asyncio.Future[None] | None = None
        # NOTE: kept: `asyncio.get_running_loop()` costs a getpid() call each time
        self._loop = loop = asyncio.get_running_loop()
        self._deadline = None if timeout is None else loop.time() + timeout
        self._timer = loop.call_later(timeout, self._expire) if timeout is not None else None

    async def read(self) -> Any:
        """The stream's next message; `grpc.aio.EOF` after its last; its error; as a cancelled
        call does, `asyncio.CancelledError` once it is cancelled."""
        while True:
            if self._plain is not None:
                return await self._plain.read()
            if self._cancelled:
                raise asyncio.CancelledError()
            if self._messages:
                return _joined(self._messages) if MERGE else self._messages.popleft()
            if self._ended:
                if self._end is not None:
                    raise self._end
                return grpc.aio.EOF
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def cancel(self) -> bool:
        """Cancel the stream (its worker aborts the request); False if it had ended."""
        if self._plain is not None:
            return bool(self._plain.cancel())
        if self._ended or self._cancelled:
            return False
        self._cancelled = True
        self._stop_timer()
        self._mux.cancel(self._stream)
        self._wake()
        return True

    def done(self) -> bool:
        if self._plain is not None:
            return bool(self._plain.done())
        return self._ended or self._cancelled

    def deliver(self, item: worker_pb2.DecodeItem) -> None:
        if item.HasField("response"):
            self._messages.append(item.response)
        else:
            end = item.end
            if end.code:
                code = _STATUS.get(end.code, grpc.StatusCode.UNKNOWN)
                self._end = _error(code, end.details, tuple(end.trailers.items()))
            self._finish()
        self._wake()

    def fail(self, err: grpc.aio.AioRpcError) -> None:
        """The call it ran on ended: so does the stream, with the call's status (a worker that
        has no DecodeMany: the stream goes on as a Decode call of its own)."""
        if err.code() is grpc.StatusCode.UNIMPLEMENTED and not self.done():
            self._stop_timer()
            now = self._loop.time()
            timeout = None if self._deadline is None else max(0.0, self._deadline - now)
            self._plain = self._mux.stub.Decode(
                self._request, timeout=timeout, metadata=self._metadata
            )
            self._wake()
            return
        if not self._ended:
            self._end = err
            self._finish()
            self._wake()

    def _expire(self) -> None:
        self._timer = None
        if not self.done():
            self._mux.cancel(self._stream)
            self._end = _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._finish()
            self._wake()

    def _finish(self) -> None:
        self._ended = True
        self._stop_timer()
        self._mux.forget(self._stream)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class DecodeMux:
    """One DecodeMany call to one decode worker and the streams on it (this event loop's)."""

    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub) -> None:
        self._controls: asyncio.Queue[worker_pb2.DecodeControl | None] = asyncio.Queue()
        self._streams: dict[int, MuxStream] = {}
        self._next = 0
        self.stub = stub
        self.closed = False
        self.unimplemented = False  # the worker has no DecodeMany (an earlier version)
        # NOTE: in a context of its own: the call lives longer than the request that opened it,
        # and must not carry that request's trace or caller
        self._task = asyncio.get_running_loop().create_task(
            self._run(stub), context=contextvars.Context()
        )

    def open(
        self, request: worker_pb2.DecodeRequest, timeout: float | None, metadata: Any
    ) -> MuxStream:
        self._next += 1
        stream = MuxStream(self, self._next, request, timeout, metadata)
        self._streams[self._next] = stream
        meta = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
        start = worker_pb2.DecodeStart(stream=self._next, request=request, metadata=meta)
        self._controls.put_nowait(worker_pb2.DecodeControl(start=start))
        return stream

    def cancel(self, stream: int) -> None:
        if self._streams.pop(stream, None) is not None and not self.closed:
            self._controls.put_nowait(worker_pb2.DecodeControl(cancel=stream))

    def forget(self, stream: int) -> None:
        self._streams.pop(stream, None)

    def close(self) -> None:
        self._controls.put_nowait(None)
        self._task.cancel()

    async def _send(self, call: Any) -> None:
        """Write the controls in order. NOTE: only once the worker accepted the call (it sends
        its metadata first): a write that meets a call the worker already ended (refused, or
        its worker gone) makes gRPC report INTERNAL in place of the worker's status."""
        try:
            await call.initial_metadata()
            while not call.done() and (control := await self._controls.get()) is not None:
                await call.write(control)
        except (grpc.RpcError, asyncio.InvalidStateError):
            return  # NOTE: the call ended; reading it tells how

    async def _run(self, stub: worker_pb2_grpc.DecodeWorkerStub) -> None:
        err = _error(grpc.StatusCode.UNAVAILABLE, "the decode worker ended the DecodeMany call")
        call = stub.DecodeMany()
        sender = asyncio.ensure_future(self._send(call))
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:
                streams = self._streams
                for item in batch.items:
                    stream = streams.get(item.stream)
                    if stream is not None:
                        stream.deliver(item)
        except grpc.aio.AioRpcError as exc:
            err = exc
            self.unimplemented = exc.code() is grpc.StatusCode.UNIMPLEMENTED
            if exc.code() is grpc.StatusCode.INTERNAL and "from Core" in (exc.details() or ""):
                # NOTE: a write met the call already ended by its worker (see `_send`)
                err = _error(grpc.StatusCode.UNAVAILABLE, f"DecodeMany call lost: {exc.details()}")
        except asyncio.CancelledError:
            call.cancel()
            err = _error(grpc.StatusCode.CANCELLED, "the gateway closed the DecodeMany call")
            raise
        finally:
            sender.cancel()
            self.closed = True
            if self._streams:
                log.info(
                    "DecodeMany call ended (%s): %d streams end", err.code(), len(self._streams)
                )
            for stream in list(self._streams.values()):
                stream.fail(err)
            self._streams.clear()


class DecodeMuxes:
    """This process's DecodeMany calls, one per decode worker address, opened on first use
    and again after one ends."""

    def __init__(self) -> None:
        self._muxes: dict[str, DecodeMux] = {}

    def open(
        self,
        stub_for: Any,
        address: str,
        request: worker_pb2.DecodeRequest,
        timeout: float | None,
        metadata: Any,
    ) -> Any:
        """A stream on the DecodeMany call to `address` (a Decode call of its own where the
        worker has no DecodeMany)."""
        mux = self._muxes.get(address)
        if mux is not None and mux.unimplemented:
            return stub_for(address).Decode(request, timeout=timeout, metadata=metadata)
        if mux is None or mux.closed:
            mux = self._muxes[address] = DecodeMux(stub_for(address))
        return mux.open(request, timeout, metadata)

    def close(self) -> None:
        for mux in self._muxes.values():
            mux.close()
        self._muxes.clear()
