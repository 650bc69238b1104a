"""DecodeMany, both sides over a real gRPC server on loopback: many Decode streams on one call,
one message per step, each stream's own errors, cancels and deadlines, and the call's end."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.decode_service.decode_many import DecodeMany
from splitserve.engine.errors import NotFound
from splitserve.gateway.decode_many import DecodeMuxes
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.runtime.auth import AuthInterceptor, member_channel_interceptors, member_check
from splitserve.runtime.grpc_server import start_server

TRAILER = "splitserve-kv-handoff"


class StepWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker's front in miniature: a clock steps every `step_s`, and each running
    stream gets one token a step (its Decode handler is what DecodeMany runs per stream)."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.step_s = step_s
        self.tick: asyncio.Event | None = None
        self.batches: list[int] = []  # items per DecodeBatch sent
        self.sent: list[worker_pb2.DecodeBatch] = []
        self.closed: list[str] = []  # request ids whose handler was closed early
        self.seen_metadata: dict[str, str] = {}

    async def _clock(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            tick, self.tick = self.tick, asyncio.Event()
            tick.set()

    async def Decode(self, request, context):  # noqa: N802 - gRPC's method name
        if self.tick is None:
            self.tick = asyncio.Event()
            asyncio.get_running_loop().create_task(self._clock())
        self.seen_metadata.update(dict(context.invocation_metadata()))
        rid = request.request_id
        if rid.startswith("missing"):
            raise NotFound(f"no reservation for request {rid!r}")
        total = request.sampling.max_tokens
        sent = 0
        if rid.startswith("burst"):  # NOTE: every token at once, two samples, as steps that
            for i in range(total):  # queued up while the call wrote its previous message
                for index in (0, 1):
                    delta = common_pb2.SampleDelta(index=index, token_ids=[i], text=f"{i},")
                    yield worker_pb2.DecodeResponse(chunk=delta)
            yield worker_pb2.DecodeResponse(finished=worker_pb2.DecodeFinished())
            return
        try:
            while sent < total:
                await self.tick.wait()
                yield worker_pb2.DecodeResponse(
                    chunk=common_pb2.SampleDelta(index=0, token_ids=[sent])
                )
                sent += 1
                if rid.startswith("moved") and sent == 3:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, "changing role", ((TRAILER, "7"),)
                    )
        except BaseException:
            if sent < total:
                self.closed.append(rid)
            raise
        yield worker_pb2.DecodeResponse(finished=worker_pb2.DecodeFinished())

    async def DecodeMany(self, controls, context):  # noqa: N802
        await context.send_initial_metadata(())
        async for batch in DecodeMany(self.Decode).serve(controls):
            self.batches.append(len(batch.items))
            self.sent.append(batch)
            yield batch


@pytest.fixture
def worker():
    servicer = StepWorker()
    server = start_server(
        lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s),
        ["splitserve.v1.DecodeWorker"],
        interceptors=[AuthInterceptor(member_check("s3cret"))],
    )
    server.set_serving(True)
    yield servicer, f"127.0.0.1:{server.port}", server
    server.stop(0)


def _request(rid: str, tokens: int) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid, sampling=common_pb2.SamplingParams(max_tokens=tokens)
    )


async def _read_all(stream) -> list[int]:
    tokens = []
    while (msg := await stream.read()) is not grpc.aio.EOF:
        if msg.HasField("chunk"):
            tokens.extend(msg.chunk.token_ids)
    return tokens


def _muxes(address: str):
    channel = grpc.aio.insecure_channel(address, interceptors=member_channel_interceptors("s3cret"))
    return channel, DecodeMuxes(), lambda _: worker_pb2_grpc.DecodeWorkerStub(channel)


def test_many_streams_share_one_call_and_one_message_per_step(worker):
    servicer, address, _ = worker

    async def main():
        channel, muxes, stub_for = _muxes(address)
        streams = [
            muxes.open(stub_for, address, _request(f"r{i}", 20), 30, (("traceparent", "t-1"),))
            for i in range(32)
        ]
        results = await asyncio.gather(*(_read_all(s) for s in streams))
        muxes.close()
        await channel.close()
        return results

    results = asyncio.run(main())
    assert results == [list(range(20))] * 32
    # one call carried all 32 streams' 21 messages each (20 tokens, finished) and 32 ends:
    # far fewer messages than the 32 * 21 a call per stream would have sent (and at most one
    # item per stream and step: tokens that queued up during a write are joined)
    assert 32 * 3 <= sum(servicer.batches) <= 32 * 22
    assert len(servicer.batches) < 32 * 22 / 8, servicer.batches
    assert servicer.seen_metadata.get("traceparent") == "t-1"


def test_a_streams_error_ends_it_alone_with_its_status_and_trailers(worker):
    servicer, address, _ = worker

    async def main():
        channel, muxes, stub_for = _muxes(address)
        ok = muxes.open(stub_for, address, _request("ok", 10), 30, None)
        missing = muxes.open(stub_for, address, _request("missing-1", 10), 30, None)
        moved = muxes.open(stub_for, address, _request("moved-1", 10), 30, None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_all(missing)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "missing-1" in err.value.details()
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while (msg := await moved.read()) is not grpc.aio.EOF:
                got.extend(msg.chunk.token_ids)
        assert got == [0, 1, 2]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(err.value.trailing_metadata())[TRAILER] == "7"
        assert await _read_all(ok) == list(range(10))
        muxes.close()
        await channel.close()

    asyncio.run(main())


def test_cancel_and_deadline_end_the_stream_on_the_worker_too(worker):
    servicer, address, _ = worker

    async def main():
        channel, muxes, stub_for = _muxes(address)
        cancelled = muxes.open(stub_for, address, _request("cancelled", 100000), 30, None)
        late = muxes.open(stub_for, address, _request("late", 100000), 0.2, None)
        other = muxes.open(stub_for, address, _request("other", 50), 30, None)
        assert (await cancelled.read()).HasField("chunk")
        pending = asyncio.ensure_future(cancelled.read())
        await asyncio.sleep(0)
        assert cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_all(late)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await _read_all(other) == list(range(50))
        for _ in range(100):
            if {"cancelled", "late"} <= set(servicer.closed):
                break
            await asyncio.sleep(0.01)
        muxes.close()
        await channel.close()

    asyncio.run(main())
    assert {"cancelled", "late"} <= set(servicer.closed)


def test_the_calls_end_ends_its_streams_and_the_next_stream_opens_a_new_call(worker):
    servicer, address, server = worker

    async def main():
        channel, muxes, stub_for = _muxes(address)
        stream = muxes.open(stub_for, address, _request("long", 100000), 30, None)
        assert (await stream.read()).HasField("chunk")
        server.stop(0)  # NOTE: the worker goes away mid-stream
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_all(stream)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        again = muxes.open(stub_for, address, _request("again", 5), 5, None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_all(again)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        muxes.close()
        await channel.close()

    asyncio.run(main())


def test_without_the_cluster_secret_the_call_is_refused(worker):
    _, address, _ = worker

    async def main():
        channel = grpc.aio.insecure_channel(address)
        muxes = DecodeMuxes()
        stream = muxes.open(
            lambda _: worker_pb2_grpc.DecodeWorkerStub(channel), address, _request("x", 3), 5, None
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_all(stream)
        muxes.close()
        await channel.close()
        return err.value.code()

    assert asyncio.run(main()) == grpc.StatusCode.UNAUTHENTICATED


def test_a_worker_without_decode_many_gets_a_decode_call_per_stream():
    """A decode worker of an earlier version (no DecodeMany: UNIMPLEMENTED) during an upgrade."""
    servicer = StepWorker()
    decode = grpc.unary_stream_rpc_method_handler(
        servicer.Decode,
        request_deserializer=worker_pb2.DecodeRequest.FromString,
        response_serializer=worker_pb2.DecodeResponse.SerializeToString,
    )
    server = start_server(
        lambda s: s.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "splitserve.v1.DecodeWorker", {"Decode": decode}
                ),
            )
        ),
        ["splitserve.v1.DecodeWorker"],
    )
    server.set_serving(True)
    address = f"127.0.0.1:{server.port}"

    async def main():
        channel, muxes, stub_for = _muxes(address)
        first = [muxes.open(stub_for, address, _request(f"a{i}", 6), 30, None) for i in range(3)]
        got = await asyncio.gather(*(_read_all(s) for s in first))
        later = muxes.open(stub_for, address, _request("b", 4), 30, None)
        got.append(await _read_all(later))
        muxes.close()
        await channel.close()
        return got, later

    try:
        got, later = asyncio.run(main())
    finally:
        server.stop(0)
    assert got == [list(range(6))] * 3 + [list(range(4))]
    assert not hasattr(later, "deliver")  # NOTE: a Decode call of its own from then on
    assert servicer.batches == []


def test_a_control_that_neither_starts_nor_cancels_ends_the_call_invalid_argument(worker):
    _, address, _ = worker

    async def main():
        channel = grpc.aio.insecure_channel(
            address, interceptors=member_channel_interceptors("s3cret")
        )
        call = worker_pb2_grpc.DecodeWorkerStub(channel).DecodeMany()
        await call.initial_metadata()
        await call.write(worker_pb2.DecodeControl())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        await channel.close()
        return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "starts or cancels" in err.details()


def test_tokens_that_queue_up_go_as_one_item_per_sample_in_order(worker):
    """A stream whose steps queue up while the call writes (here: all of them at once) sends
    one chunk per sample with every token, text and all, in order; then its final message."""
    servicer, address, _ = worker

    async def main():
        channel, muxes, stub_for = _muxes(address)
        stream = muxes.open(stub_for, address, _request("burst-1", 6), 30, ())
        got = []
        while (msg := await stream.read()) is not grpc.aio.EOF:
            got.append(msg)
        muxes.close()
        await channel.close()
        return got

    got = asyncio.run(main())
    chunks = [m.chunk for m in got if m.HasField("chunk")]
    assert [(c.index, list(c.token_ids), c.text) for c in chunks] == [
        (0, list(range(6)), "0,1,2,3,4,5,"),
        (1, list(range(6)), "0,1,2,3,4,5,"),
    ]
    assert got[-1].HasField("finished")
    items = [item for batch in servicer.sent for item in batch.items]
    assert [i.WhichOneof("kind") for i in items] == ["response"] * 3 + ["end"], items


def test_a_reader_that_falls_behind_takes_what_queued_up_as_one_message(worker):
    """The gateway's side: a stream not read for a while (its worker stepping on to its end)
    hands what arrived meanwhile to its next read as one message, every token in order."""
    servicer, address, _ = worker

    async def main():
        channel, muxes, stub_for = _muxes(address)
        stream = muxes.open(stub_for, address, _request("slow-1", 40), 30, ())
        first = await stream.read()
        # NOTE: not read again until the worker sent the stream's end (and a little more)
        while not any(i.HasField("end") for b in servicer.sent for i in b.items):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        rest = []
        while (msg := await stream.read()) is not grpc.aio.EOF:
            rest.append(msg)
        muxes.close()
        await channel.close()
        return first, rest

    first, rest = asyncio.run(main())
    tokens = list(first.chunk.token_ids) + [t for m in rest for t in m.chunk.token_ids]
    assert tokens == list(range(40))
    chunks = [m for m in rest if m.HasField("chunk")]
    assert len(chunks) == 1, [list(m.chunk.token_ids) for m in chunks]
    assert rest[-1].HasField("finished")
