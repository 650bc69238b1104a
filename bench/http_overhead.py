"""HTTP vs gRPC at the gateway: what the OpenAI-compatible API adds per streamed token.

    python -m bench.http_overhead                    # tiny model, 1 prefill + 1 decode worker
    python -m bench.http_overhead --concurrency 1 16 64 --rounds 5
    python -m bench.http_overhead --smoke            # CPU: checks that it runs

One real stack (`splitserve.launch.up`: redis-server, a prefill and a decode worker, the gateway
with `--http-port`); the same greedy streams (random token-id prompts, EOS ignored) go through the
gRPC `Generate` and through `POST /v1/completions` with `stream: true`, in alternating rounds,
from one asyncio client. The tiny model makes tokens cheap, so what the gateway adds per token
is as large a share as it gets. Reported per API and concurrency: inter-chunk latency (ITL:
every gap between streamed chunks, one chunk per gateway message either way) at p50 / p99, and
time per output token ((last chunk - first chunk) / (tokens - 1)) at p50 / p99; the overhead is
HTTP's figure minus gRPC's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.common import device_name, table, write_results
from splitserve.launch.up import StackSettings, start_stack
from splitserve.protos.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from splitserve.testing.tiny_model import make_tiny_model


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _grpc_one(stub: Any, prompt: list[int], max_tokens: int) -> list[float]:
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )
    arrivals = []
    async for msg in stub.Generate(request, timeout=600):
        if msg.HasField("chunk"):
            arrivals.append(time.perf_counter())
    return arrivals


async def _http_one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> list[float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    arrivals = []
    async with http.stream("POST", "/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("finish_reason") is None:
                    arrivals.append(time.perf_counter())
    return arrivals


async def _round(
    api: str, target: Any, prompts: list[list[int]], max_tokens: int
) -> list[list[float]]:
    one = _grpc_one if api == "grpc" else _http_one
    return list(await asyncio.gather(*(one(target, p, max_tokens) for p in prompts)))


async def _measure(stack: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    rows = []
    async with (
        grpc.aio.insecure_channel(stack.address) as channel,
        httpx.AsyncClient(base_url=stack.http_url, timeout=600) as http,
    ):
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for concurrency in args.concurrency:
            samples: dict[str, list[list[float]]] = {"grpc": [], "http": []}
            for r in range(args.rounds + 1):  # round 0 warms up
                prompts = [
                    [rng.randrange(5, 500) for _ in range(args.prompt_len)]
                    for _ in range(concurrency)
                ]
                for api in ("grpc", "http") if r % 2 else ("http", "grpc"):
                    got = await _round(
                        api, stub if api == "grpc" else http, prompts, args.max_tokens
                    )
                    if r:
                        samples[api] += got
            figures = {api: _figures(streams) for api, streams in samples.items()}
            for api in ("grpc", "http"):
                rows.append({"api": api, "concurrency": concurrency, **figures[api]})
            rows.append(
                {
                    "api": "http - grpc",
                    "concurrency": concurrency,
                    **{k: figures["http"][k] - figures["grpc"][k] for k in figures["grpc"]},
                }
            )
    return rows


def _figures(streams: list[list[float]]) -> dict[str, float]:
    gaps = [b - a for s in streams for a, b in zip(s, s[1:], strict=False)]
    per_token = [(s[-1] - s[0]) / (len(s) - 1) for s in streams if len(s) > 1]
    return {
        "itl_p50_ms": 1e3 * _pct(gaps, 0.5),
        "itl_p99_ms": 1e3 * _pct(gaps, 0.99),
        "tpot_p50_ms": 1e3 * _pct(per_token, 0.5),
        "tpot_p99_ms": 1e3 * _pct(per_token, 0.99),
        "tpot_mean_ms": 1e3 * statistics.fmean(per_token) if per_token else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default="bench/results/http_overhead.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.rounds, args.max_tokens = [2], 1, 8
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama", "llama")
        # NOTE: both workers may share one GPU: each takes a share of its memory, not 90%.
        share = ("--gpu-memory-utilization", "0.3")
        stack = start_stack(
            StackSettings(model=str(model), http_port=0, extra_worker_args=share)
        )
        try:
            rows = asyncio.run(_measure(stack, args))
        finally:
            stack.stop()
    meta = {
        "device": device_name(),
        "model": "tiny llama (2 layers, hidden 64), float32 checkpoint, dtype auto",
        "workload": f"{args.prompt_len}-token random prompts, {args.max_tokens} tokens, greedy, "
        f"EOS ignored; {args.rounds} rounds per API after a warm-up, APIs alternating",
    }
    print(table(rows, list(rows[0])))
    write_results(args.out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
