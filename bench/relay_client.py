"""The load of `bench/relay.py`: `--streams` concurrent Generate streams over the public gRPC API,
each asking again as soon as its request ends, counting the tokens that arrive inside a
wall-clock window. One process; the benchmark starts several so that the client is not what
limits the gateway.

    python -m bench.relay_client --address 127.0.0.1:PORT --streams 64 --start T0 --end T1

Prints one JSON line: tokens, messages and requests seen inside [start, end), errors by status,
`gap_hist`: the gaps between a stream's consecutive token messages inside the window, as a
histogram of 0.1 ms buckets (bucket -> count; the benchmark merges them and reads p50/p99), and
`itl_hist`: the same per token, a message's gap spread evenly over its k tokens (k entries of
gap / k, as the gateway's inter-token latency metric counts it). A message that merges k
tokens is one long gap but k short inter-token latencies: the two together show what merging
does to latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter

import grpc

from splitserve.protos.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


async def _stream(
    stub: gateway_pb2_grpc.GatewayStub,
    request: gateway_pb2.GenerateRequest,
    start: float,
    end: float,
    seen: Counter,
    gaps: Counter,
    itls: Counter,
) -> None:
    while time.time() < end:
        last = 0.0  # when this stream's previous token message came (0: none yet)
        try:
            async for msg in stub.Generate(request, timeout=max(1.0, end - time.time() + 30)):
                now = time.time()
                if msg.HasField("chunk") and start <= now < end:
                    num_tokens = len(msg.chunk.token_ids)
                    seen["tokens"] += num_tokens
                    seen["messages"] += 1
                    if last and num_tokens:
                        gaps[int((now - last) * GAP_BUCKETS_PER_S)] += 1
                        itls[int((now - last) / num_tokens * GAP_BUCKETS_PER_S)] += num_tokens
                if msg.HasField("chunk"):
                    last = now
                elif msg.HasField("finished") and start <= now < end:
                    seen["requests"] += 1
                if now >= end:
                    return
        except grpc.aio.AioRpcError as err:
            seen[f"error_{err.code().name}"] += 1
            await asyncio.sleep(0.05)


GAP_BUCKETS_PER_S = 10_000  # gap histogram resolution: 0.1 ms


async def _run(args: argparse.Namespace) -> tuple[Counter, Counter, Counter]:
    seen: Counter = Counter()
    gaps: Counter = Counter()
    itls: Counter = Counter()
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=list(range(10, 10 + args.prompt_len))),
        sampling=common_pb2.SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
        ),
    )
    if args.stream_interval:
        request.stream_interval = args.stream_interval
    async with grpc.aio.insecure_channel(args.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await asyncio.gather(
            *(
                _stream(stub, request, args.start, args.end, seen, gaps, itls)
                for _ in range(args.streams)
            )
        )
    return seen, gaps, itls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--start", type=float, required=True, help="window start (time.time())")
    parser.add_argument("--end", type=float, required=True, help="window end (time.time())")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--stream-interval", type=int, default=0, help="0: the gateway's")
    args = parser.parse_args(argv)
    seen, gaps, itls = asyncio.run(_run(args))
    print(json.dumps({**seen, "gap_hist": dict(gaps), "itl_hist": dict(itls)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
