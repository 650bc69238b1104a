"""A DecodeMany stream's plain chunks skip its task (decode_service/pace.py): the front's
hand-off offers each output to the stream's `direct` while nothing waits in its queue; the final
output, errors and outputs behind a queued one take the queue, so a stream's order holds."""

from __future__ import annotations

import asyncio

from splitserve.decode_service.decode_many import DecodeMany
from splitserve.decode_service.pace import Pace
from splitserve.engine.outputs import CompletionOutput, RequestOutput
from splitserve.protos.v1 import common_pb2, worker_pb2
from splitserve.runtime.engine_core.client import StreamQueue, _put_all


def _out(num_tokens: int, finished: bool = False) -> RequestOutput:
    tokens = list(range(num_tokens))
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", tokens)], finished=finished)


def test_the_hand_off_offers_an_output_to_direct_only_while_the_queue_is_empty():
    async def scenario() -> None:
        taken: list[object] = []
        q = StreamQueue()
        q.direct = lambda item: taken.append(item) or True
        other = StreamQueue()  # no direct: queued as before
        _put_all([(q, "a"), (other, "x")])
        assert taken == ["a"] and q.empty() and other.get_nowait() == "x"
        q.direct = lambda item: False  # declined (the final output): queued
        _put_all([(q, "b")])
        q.direct = lambda item: taken.append(item) or True
        _put_all([(q, "c")])  # behind "b", still queued: not offered
        assert taken == ["a"] and [q.get_nowait(), q.get_nowait()] == ["b", "c"]

    asyncio.run(scenario())


def test_a_direct_that_fails_queues_its_output_and_the_others_still_go_out():
    async def scenario() -> None:
        def broken(item: object) -> bool:
            raise RuntimeError("bad output")

        q, after = StreamQueue(), StreamQueue()
        q.direct = broken
        taken: list[object] = []
        after.direct = lambda item: taken.append(item) or True
        _put_all([(q, "a"), (after, "b")])
        assert q.get_nowait() == "a" and taken == ["b"]

    asyncio.run(scenario())


def test_pace_sends_every_interval_tokens_and_leaves_the_end_to_the_task():
    sent: list[int] = []
    pace = Pace(3)
    take = pace.taker(lambda out: sent.append(len(out.outputs[0].token_ids)))
    assert all(take(_out(n)) for n in range(1, 8))  # kept, sent or not (outputs are cumulative)
    assert sent == [3, 6]
    assert take(_out(8, finished=True)) is False  # the final output goes the task's way
    assert take(RuntimeError("engine failed")) is False
    assert pace.due(_out(8, finished=True)) and sent == [3, 6]


def test_direct_chunks_join_the_next_message_in_order_and_a_cancelled_stream_drops_them():
    async def scenario() -> list[worker_pb2.DecodeBatch]:
        sinks: dict[str, object] = {}
        finish = {rid: asyncio.Event() for rid in ("a", "b")}

        async def decode(request, context):  # a handler whose chunks all go to its sink
            sinks[request.request_id] = context.direct_sink
            await finish[request.request_id].wait()
            yield worker_pb2.DecodeResponse(finished=worker_pb2.DecodeFinished())

        done = asyncio.Event()
        start = [
            worker_pb2.DecodeControl(start=worker_pb2.DecodeStart(
                stream=i, request=worker_pb2.DecodeRequest(request_id=rid)))
            for i, rid in enumerate(("a", "b"))
        ]  # fmt: skip
        cancel_b = asyncio.Event()
        many = DecodeMany(decode)

        async def controls():
            for control in start:
                yield control
            await cancel_b.wait()
            yield worker_pb2.DecodeControl(cancel=1)
            await done.wait()

        batches: list[worker_pb2.DecodeBatch] = []

        async def read() -> None:
            async for batch in many.serve(controls()):
                batches.append(batch)
                if any(item.HasField("end") for item in batch.items):
                    done.set()
                    return

        reader = asyncio.ensure_future(read())
        while len(sinks) < 2:
            await asyncio.sleep(0)
        for i in range(3):  # one step's hand-off: a chunk per stream, three steps in a row
            sinks["a"](common_pb2.SampleDelta(index=0, token_ids=[i], text=f"{i},"))
            sinks["b"](common_pb2.SampleDelta(index=0, token_ids=[10 + i]))
        await asyncio.sleep(0.01)
        cancel_b.set()
        await asyncio.sleep(0.01)
        sinks["b"](common_pb2.SampleDelta(index=0, token_ids=[99]))  # cancelled: dropped
        sinks["a"](common_pb2.SampleDelta(index=0, token_ids=[3], text="3,"))
        finish["a"].set()
        await asyncio.wait_for(reader, 5)
        return batches

    batches = asyncio.run(scenario())
    first = batches[0]
    # the three steps' chunks joined, one item per stream, in the order they came
    assert [(i.stream, list(i.response.chunk.token_ids)) for i in first.items] == [
        (0, [0, 1, 2]), (1, [10, 11, 12])
    ]
    assert first.items[0].response.chunk.text == "0,1,2,"
    rest = [i for b in batches[1:] for i in b.items]
    assert all(i.stream == 0 for i in rest)  # nothing of the cancelled stream
    kinds = [i.response.WhichOneof("kind") if i.HasField("response") else "end" for i in rest]
    assert kinds == ["chunk", "finished", "end"]
    assert list(rest[0].response.chunk.token_ids) == [3]
