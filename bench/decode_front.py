"""The decode worker front's cost per streamed token (CPU, no GPU): DecodeMany streams fed one
engine step's outputs at a time, each stream's chunks through its own task or handed on where
the step's outputs are delivered (decode_service/pace.py), in alternating rounds.

    python -m bench.decode_front --streams 128 --steps 300 --rounds 3 --out /tmp/front.json

Real: the `DecodeWorker` servicer's Decode handler and its observer (tracing off, metrics on),
DecodeMany, the stream queues and the front's per-step hand-off (`_put_all`). Stand-in: the
worker's `decode` (its output loop as `DecodeWorker.decode` runs it, without admission, Redis
or an engine core), and the outputs, built as the front's assembler builds them (cumulative
token ids and text). Reported: process CPU per token over the whole run and tokens per CPU
second, with chunks through the stream's task (`SPLITSERVE_DECODE_DIRECT=0`'s path) and direct.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from bench.common import table, write_results
from splitserve.decode_service import decode_many
from splitserve.decode_service.pace import Pace
from splitserve.engine.outputs import CompletionOutput, RequestOutput
from splitserve.launch.decode_start import decode_servicer
from splitserve.protos.v1 import worker_pb2
from splitserve.runtime.engine_core.client import StreamQueue, _put_all
from splitserve.runtime.metrics import Metrics
from splitserve.runtime.tracing import Tracing


class StandInWorker:
    """`DecodeWorker.decode`'s output loop over a queue this bench feeds."""

    def __init__(self) -> None:
        self.queues: dict[str, StreamQueue] = {}

    async def decode(
        self, request_id: str, params: Any, first_tokens: Any, priority: int,
        on_admitted: Callable[[], None] | None = None, num_resumed_handed_off: Any = None,
        direct: Callable[[RequestOutput], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        outputs = self.queues[request_id] = StreamQueue()
        if on_admitted is not None:
            on_admitted()
        pace, finished = Pace(1), False
        if direct is not None:
            outputs.direct = pace.taker(direct)
        try:
            while not finished:
                item = await outputs.get()
                while not outputs.empty():
                    item = outputs.get_nowait()
                finished = item.finished
                if pace.due(item):
                    yield item
        finally:
            outputs.direct = None


async def one_run(streams: int, steps: int, direct: bool) -> dict[str, Any]:
    decode_many.DIRECT = direct
    worker = StandInWorker()
    servicer = decode_servicer(worker, Tracing.disabled(), Metrics("bench"))  # type: ignore[arg-type]
    many = decode_many.DecodeMany(servicer.Decode)
    done = asyncio.Event()

    async def controls() -> AsyncIterator[worker_pb2.DecodeControl]:
        for i in range(streams):
            request = worker_pb2.DecodeRequest(request_id=f"r{i}")
            request.sampling.max_tokens = steps
            yield worker_pb2.DecodeControl(start=worker_pb2.DecodeStart(stream=i, request=request))
        await done.wait()

    counts = {"tokens": 0, "ends": 0, "messages": 0}

    async def read() -> None:
        async for batch in many.serve(controls()):
            counts["messages"] += 1
            for item in batch.items:
                if item.HasField("end"):
                    counts["ends"] += 1
                elif item.response.HasField("chunk"):
                    counts["tokens"] += len(item.response.chunk.token_ids)
            if counts["ends"] == streams:
                done.set()
                return

    reader = asyncio.ensure_future(read())
    while len(worker.queues) < streams:
        await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = time.process_time()
    for step in range(steps):
        batch = []
        for request_id, q in worker.queues.items():
            tokens = list(range(step + 1))
            sample = CompletionOutput(0, "ab" * (step + 1), tokens)
            batch.append((q, RequestOutput(request_id, None, [1], [sample], step == steps - 1)))
        loop.call_soon(_put_all, batch)  # NOTE: as the receiver thread hands a step over
        await asyncio.sleep(0)  # the step's hand-off, the stream tasks it woke, the sender
        await asyncio.sleep(0)
    await asyncio.wait_for(reader, 60)
    cpu = time.process_time() - started
    assert counts["tokens"] == streams * steps, counts
    return {
        "path": "direct" if direct else "stream task",
        "tokens": counts["tokens"],
        "messages": counts["messages"],
        "cpu_s": round(cpu, 3),
        "us_per_token": round(1e6 * cpu / counts["tokens"], 2),
        "tokens_per_cpu_s": round(counts["tokens"] / cpu),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/decode_front.json")
    args = parser.parse_args(argv)
    rows, was = [], decode_many.DIRECT
    try:
        for _ in range(args.rounds):
            for direct in (False, True):
                rows.append(asyncio.run(one_run(args.streams, args.steps, direct)))
    finally:
        decode_many.DIRECT = was
    print(table(rows, list(rows[0])))
    by = {p: [r["us_per_token"] for r in rows if r["path"] == p] for p in ("stream task", "direct")}
    saved = 1 - min(by["direct"]) / min(by["stream task"])
    print(f"best of {args.rounds}: {min(by['stream task'])} us/token through the stream's task, "
          f"{min(by['direct'])} direct ({100 * saved:.0f}% less)")  # fmt: skip
    results = {"streams": args.streams, "steps": args.steps, "rows": rows, "saved": saved}
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main()
