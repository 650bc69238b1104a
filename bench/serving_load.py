"""The serving benchmark's load client: requests at Poisson arrival times (open loop) or a
fixed number in flight (closed loop), from one or several client processes, each request's token
arrival times recorded."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.client import stream
from splitserve.engine.sampling_params import SamplingParams
from splitserve.protos.v1 import gateway_pb2_grpc

SLO_TTFT_S, SLO_TPOT_S, SLO_ATTAINMENT = 1.0, 0.040, 0.9
CHANNELS_PER_CLIENT = 8  # connections each client process opens (requests round-robin)


@dataclass
class Record:
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    status: str = "OK"

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0

    @property
    def meets_slo(self) -> bool:
        return self.status == "OK" and self.ttft <= SLO_TTFT_S and self.tpot <= SLO_TPOT_S


def _one(stub: Any, prompt: list[int], max_tokens: int, record: Record, timeout_s: float) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    record.sent = time.monotonic()
    try:
        for msg in stream(stub, prompt, params, timeout_s=timeout_s):
            if msg.HasField("chunk"):
                now = time.monotonic()
                record.token_times.extend([now] * max(1, len(msg.chunk.token_ids)))
    except grpc.RpcError as exc:
        record.status = exc.code().name  # type: ignore[attr-defined]
    if record.status == "OK" and len(record.token_times) != max_tokens:
        record.status = f"SHORT({len(record.token_times)}/{max_tokens})"


def run_load(
    address: str, requests: Sequence[tuple[list[int], int]], rate: float, seed: int,
    timeout_s: float, client_processes: int = 1, concurrency: int = 0,
) -> tuple[list[Record], float]:  # fmt: skip
    """Send `requests` at Poisson arrivals of `rate`/s (open loop); their records and the
    arrival window's length. With `client_processes` > 1 the requests are dealt round-robin to
    that many client processes (one Python client is itself a ceiling near 10k tokens/s)."""
    rng = random.Random(seed)
    offsets, due = [], 0.0
    for _ in requests:
        due += rng.expovariate(rate)
        offsets.append(due)
    items = [(p, m, o) for (p, m), o in zip(requests, offsets, strict=True)]
    return run_schedule(address, items, timeout_s, client_processes, concurrency), (
        offsets[-1] if offsets else 0.0
    )


def run_schedule(
    address: str, items: Sequence[tuple[list[int], int, float]], timeout_s: float,
    client_processes: int = 1, concurrency: int = 0,
) -> list[Record]:  # fmt: skip
    """Send each (prompt, max_tokens, arrival offset in seconds) at its offset (a schedule made
    elsewhere, e.g. phases of different traffic); their records, in order."""
    items = list(items)
    start = time.monotonic() + 0.5
    if client_processes <= 1:
        raw = _client(address, items, start, timeout_s, concurrency)
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(client_processes, mp_context=ctx) as pool:
            shares = [items[i::client_processes] for i in range(client_processes)]
            lanes = concurrency // client_processes
            futures = [pool.submit(_client, address, sh, start, timeout_s, lanes) for sh in shares]
            parts = [f.result() for f in futures]
        raw = [None] * len(items)  # type: ignore[list-item]
        for i, part in enumerate(parts):
            raw[i::client_processes] = part
    return [Record(sent=sent, token_times=times, status=st) for sent, times, st in raw]


def _client(
    address: str,
    items: list[tuple[list[int], int, float]],
    start: float,
    timeout_s: float,
    concurrency: int = 0,
) -> list[tuple[float, list[float], str]]:
    """One client process (or the caller): streams its requests at their arrival offsets
    from `start` (a CLOCK_MONOTONIC time, the same in every process of the host), or, with
    `concurrency`, keeps that many in flight (closed loop: a steady batch on the workers)."""
    # NOTE: connections of their own (no shared subchannel): a gateway's processes share its
    # port per connection (SO_REUSEPORT), so one connection would reach one process only.
    channels = [
        grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", 16 << 20),
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        for _ in range(CHANNELS_PER_CLIENT)
    ]
    stubs = [gateway_pb2_grpc.GatewayStub(channel) for channel in channels]
    records = [Record() for _ in items]
    threads = []
    if concurrency:
        lanes = [list(range(i, len(items), concurrency)) for i in range(concurrency)]

        def lane(indices: list[int]) -> None:
            for k in indices:
                _one(stubs[k % len(stubs)], items[k][0], items[k][1], records[k], timeout_s)

        threads = [threading.Thread(target=lane, args=(ix,), daemon=True) for ix in lanes]
        for thread in threads:
            thread.start()
    for (prompt, max_tokens, offset), record in zip(items, records, strict=True):
        if concurrency:
            break
        time.sleep(max(0.0, start + offset - time.monotonic()))
        stub = stubs[len(threads) % len(stubs)]
        thread = threading.Thread(
            target=_one, args=(stub, prompt, max_tokens, record, timeout_s), daemon=True
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout_s + 30)
    for channel in channels:
        channel.close()
    return [(r.sent, r.token_times, r.status) for r in records]
