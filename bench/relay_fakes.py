"""Fake fast workers for `bench/relay.py`: real gRPC servers on loopback that implement the worker
API (protos/v1/worker.proto) and join a real Redis registry as real workers do, but compute
nothing: a Prefill answers its first token at once, a Decode stream sends `max_tokens` tokens as
fast as the gateway reads them, `--tokens-per-message` of them per DecodeResponse (what a decode
worker that coalesces its own messages sends). With `--step-ms` a stream makes one token per step
instead, as a decode worker does, and sends every token that queued up while the gateway was not
reading in one message (at least `--tokens-per-message` of them, but for the last).

    python -m bench.relay_fakes --redis-url redis://… --decode 1 --prefill 1 [--step-ms 0]

It prints one line, "ready", once every fake worker is registered, and serves until stdin
closes (the benchmark's end) or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from collections.abc import AsyncIterator

import grpc

from splitserve.gateway.relay import MERGE
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 16
TTL_S = 3.0
VOCAB = 256  # token ids the fake streams send (the tiny model's vocabulary is larger)


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str, tokens_per_message: int, step_s: float) -> None:
        self.worker_id = worker_id
        self.tokens_per_message = tokens_per_message
        self.step_s = step_s
        # NOTE: one message object per shape, built once: the fake must cost less than the
        # gateway it feeds (gRPC serializes the same object again for every write).
        self._chunks = {
            n: worker_pb2.DecodeResponse(
                chunk=common_pb2.SampleDelta(index=0, token_ids=[7] * n, text="x" * n)
            )
            for n in range(1, tokens_per_message + 1)
        }

    async def Reserve(self, request, context):  # noqa: N802 - gRPC's method name
        blocks = (len(request.prompt_token_ids) + BLOCK_SIZE - 1) // BLOCK_SIZE
        return worker_pb2.ReserveResponse(
            destination=worker_pb2.KVDestination(
                worker_id=self.worker_id,
                address="127.0.0.1:1",
                block_ids=list(range(blocks)),
                fence=1,
                kv_transports=["grpc"],
            )
        )

    def _chunk(self, n: int) -> worker_pb2.DecodeResponse:
        if n not in self._chunks:
            self._chunks[n] = worker_pb2.DecodeResponse(
                chunk=common_pb2.SampleDelta(index=0, token_ids=[7] * n, text="x" * n)
            )
        return self._chunks[n]

    async def Decode(self, request, context) -> AsyncIterator[worker_pb2.DecodeResponse]:  # noqa: N802
        total = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        sent = 0
        if not self.step_s:
            while sent < total:
                n = min(self.tokens_per_message, total - sent)
                yield self._chunks[n]
                sent += n
        else:  # NOTE: as a decode worker does: a token a step, and what queued up in one message
            loop = asyncio.get_running_loop()
            start = loop.time()
            while sent < total:
                made = min(total, int((loop.time() - start) / self.step_s) + 1)
                if made - sent < self.tokens_per_message and made < total:
                    due = start + (sent + self.tokens_per_message - 1) * self.step_s
                    await asyncio.sleep(due - loop.time())
                    continue
                yield self._chunk(made - sent)
                sent = made
        finish = common_pb2.SampleFinish(index=0, finish_reason=common_pb2.FINISH_REASON_LENGTH)
        usage = common_pb2.Usage(
            prompt_tokens=len(request.first_tokens) and 8, completion_tokens=total
        )
        yield worker_pb2.DecodeResponse(
            finished=worker_pb2.DecodeFinished(samples=[finish], usage=usage)
        )

    async def DecodeMany(self, controls, context) -> AsyncIterator[worker_pb2.DecodeBatch]:  # noqa: N802
        """As a decode worker does: a step gives every stream on the call its next token(s)
        (`--tokens-per-message`; with `--step-ms`, those of every step since the last message,
        joined in one item per stream as a decode worker joins them; `SPLITSERVE_RELAY_MERGE=0`:
        an item per step), and one message carries the steps' tokens of all of them. Without
        `--step-ms` the next step begins once the previous message is written (as fast as the
        gateway reads)."""
        streams: dict[int, list[int]] = {}  # stream -> [tokens sent, tokens to send]
        woken = asyncio.Event()

        async def read() -> None:
            async for control in controls:
                if control.WhichOneof("kind") == "start":
                    sampling = control.start.request.sampling
                    total = sampling.max_tokens if sampling.HasField("max_tokens") else 16
                    streams[control.start.stream] = [0, total]
                else:
                    streams.pop(control.cancel, None)
                woken.set()

        await context.send_initial_metadata(())  # NOTE: the gateway waits for it to write
        reader = asyncio.ensure_future(read())
        loop = asyncio.get_running_loop()
        step, start, per_step = 0, loop.time(), self.tokens_per_message
        try:
            while True:
                if not streams:
                    woken.clear()
                    await woken.wait()
                    continue
                steps = 1
                if self.step_s:
                    due = start + (step + 1) * self.step_s
                    if due > loop.time():
                        await asyncio.sleep(due - loop.time())
                    steps = max(1, int((loop.time() - start) / self.step_s) - step)
                step += steps
                items = []
                for sid, progress in list(streams.items()):
                    n = min(steps * per_step, progress[1] - progress[0])
                    progress[0] += n
                    if MERGE:
                        items.append(worker_pb2.DecodeItem(stream=sid, response=self._chunk(n)))
                    else:  # NOTE: a step's tokens per item, as the worker sent before it merged
                        for k in range(0, n, per_step):
                            chunk = self._chunk(min(per_step, n - k))
                            items.append(worker_pb2.DecodeItem(stream=sid, response=chunk))
                    if progress[0] >= progress[1]:
                        del streams[sid]
                        done = self._finished(progress[1])
                        items.append(worker_pb2.DecodeItem(stream=sid, response=done))
                        items.append(worker_pb2.DecodeItem(stream=sid, end=worker_pb2.DecodeEnd()))
                yield worker_pb2.DecodeBatch(items=items)
        finally:
            reader.cancel()

    @staticmethod
    def _finished(total: int) -> worker_pb2.DecodeResponse:
        finish = common_pb2.SampleFinish(index=0, finish_reason=common_pb2.FINISH_REASON_LENGTH)
        usage = common_pb2.Usage(prompt_tokens=8, completion_tokens=total)
        return worker_pb2.DecodeResponse(
            finished=worker_pb2.DecodeFinished(samples=[finish], usage=usage)
        )

    async def Abort(self, request, context):  # noqa: N802
        return common_pb2.AbortResponse(aborted=False)

    async def GetStats(self, request, context):  # noqa: N802
        return worker_pb2.WorkerStats(worker_id=self.worker_id)


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    async def Prefill(self, request, context):  # noqa: N802
        return worker_pb2.PrefillResponse(first_tokens=[worker_pb2.FirstToken(index=0, token_id=7)])

    async def Abort(self, request, context):  # noqa: N802
        return common_pb2.AbortResponse(aborted=False)

    async def GetStats(self, request, context):  # noqa: N802
        return worker_pb2.WorkerStats(worker_id=self.worker_id)


def _info(kind: str, worker_id: str, port: int) -> WorkerInfo:
    """What a real worker's heartbeat says (splitserve/launch/workers.py worker_info), with a large
    pool and batch so that the gateway's advertised limits never refuse the load."""
    return WorkerInfo(
        worker_id=worker_id,
        kind=kind,
        address=f"127.0.0.1:{port}",
        num_free_blocks=1 << 20,
        num_total_blocks=1 << 20,
        block_size=BLOCK_SIZE,
        kv_transports=("grpc",),
        max_num_seqs=4096,
        max_model_len=1 << 16,
        kv_dtype="float32",
    )


async def _serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    registry = Registry(args.redis_url)
    servers, infos = [], []
    kinds = [("decode", i) for i in range(args.decode)] + [
        ("prefill", i) for i in range(args.prefill)
    ]
    for kind, i in kinds:
        worker_id = f"{args.id_prefix}fake-{kind}-{i}"
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        if kind == "decode":
            servicer = FakeDecode(worker_id, args.tokens_per_message, args.step_ms / 1000)
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        else:
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(FakePrefill(worker_id), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        infos.append(_info(kind, worker_id, port))
    for info in infos:
        await asyncio.to_thread(registry.register_worker, info, TTL_S)
    print("ready", flush=True)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), TTL_S / 3)
        except TimeoutError:
            for info in infos:
                await asyncio.to_thread(registry.heartbeat, info, TTL_S)
    for info in infos:
        registry.deregister_worker(info.kind, info.worker_id)
    for server in servers:
        await server.stop(0)
    registry.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--tokens-per-message", type=int, default=1)
    parser.add_argument("--id-prefix", default="", help="before each worker id")
    parser.add_argument("--step-ms", type=float, default=0.0, help="0: as fast as read")
    args = parser.parse_args(argv)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def on_stop(*_: object) -> None:
        loop.call_soon_threadsafe(stop.set)

    signal.signal(signal.SIGTERM, on_stop)
    # NOTE: the benchmark holds our stdin: when it goes away, so do we.
    threading.Thread(target=lambda: (sys.stdin.read(), on_stop()), daemon=True).start()
    loop.run_until_complete(_serve(args, stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
