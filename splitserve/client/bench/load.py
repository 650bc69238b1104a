"""Sending the load: conversations at their arrival times, at most `max_concurrency` requests in
flight, from one or several client processes; each client measures its own CPU use.

Each client process runs one asyncio loop (no thread per request), so one process keeps
hundreds of streams; past about one core of CPU its own delays would show up as latency, so
`num_client_processes` deals the conversations round-robin to that many processes, which start
together on the host's monotonic clock and send back their results to be merged.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import Empty

from splitserve.client.bench.backends import Target, open_sender
from splitserve.client.bench.datasets import Conversation
from splitserve.client.bench.metrics import RequestResult

CPU_WARNING = 0.9  # a client process busy this fraction of a core: its figures are suspect


def cpu_warning(fractions: list[float]) -> str | None:
    """A warning when a client process kept a core busy (its own delays would be counted as
    the server's latency), else None."""
    busiest = max(fractions, default=0.0)
    if busiest <= CPU_WARNING:
        return None
    return (
        f"WARNING: a client process used {busiest:.0%} of a core: the client may be what "
        "limits these figures; rerun with more --num-client-processes"
    )


def arrival_offsets(
    count: int, rate: float, burstiness: float = 1.0, fixed: bool = False, seed: int = 0
) -> list[float]:
    """Seconds from the start at which each conversation begins: all at 0 for an infinite
    rate; every 1/rate for `fixed`; else gaps drawn from a gamma distribution of mean 1/rate
    and shape `burstiness` (1: Poisson arrivals; below 1 burstier, above 1 steadier), as
    `vllm bench serve` draws them. The first arrives at 0."""
    if math.isinf(rate):
        return [0.0] * count
    if fixed:
        return [i / rate for i in range(count)]
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(now)
    return offsets


@dataclass
class ClientRun:
    """What one client process sends back: its results, when it finished, its CPU and wall
    seconds over the run."""

    results: list[RequestResult] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0

    @property
    def cpu_fraction(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


async def _send_all(
    target: Target,
    items: list[tuple[Conversation, float]],
    starting: Callable[[], float],
    max_concurrency: int,
    on_done: Callable[[], None],
) -> tuple[list[RequestResult], float]:
    sender = open_sender(target)
    await sender.connect()  # NOTE: no request of the run pays for opening a connection
    start = starting()
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    results: list[RequestResult] = []

    async def converse(conversation: Conversation, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        replies: list[str] = []
        for index, turn in enumerate(conversation.turns):
            prompt = conversation.prompt(index, replies)
            if gate is None:
                result = await sender.send(prompt, turn.output_tokens)
            else:
                async with gate:
                    result = await sender.send(prompt, turn.output_tokens)
            results.append(result)
            on_done()
            if not result.success:  # NOTE: the rest of the conversation counts as failed
                for _ in conversation.turns[index + 1 :]:
                    results.append(RequestResult(error="an earlier turn failed"))
                    on_done()
                return
            replies.append(result.text)

    try:
        await asyncio.gather(*(converse(c, o) for c, o in items))
    finally:
        await sender.close()
    return results, start


def _soon() -> float:
    return time.monotonic() + 0.05


def run_client(
    target: Target,
    items: list[tuple[Conversation, float]],
    starting: Callable[[], float] = _soon,
    max_concurrency: int = 0,
    on_done: Callable[[], None] = lambda: None,
) -> ClientRun:
    """Send `items` (each conversation with its offset from the start, a CLOCK_MONOTONIC time
    that `starting` answers once the sender is connected) in this process."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    results, start = asyncio.run(_send_all(target, items, starting, max_concurrency, on_done))
    end = time.monotonic()
    return ClientRun(results, start, end, time.process_time() - cpu0, end - wall0)


def _child(target, items, max_concurrency, queue, go, start_at) -> None:  # type: ignore[no-untyped-def]
    def starting() -> float:  # NOTE: connected; every client waits for the others
        queue.put("ready")
        go.wait()
        return float(start_at.value)

    queue.put(run_client(target, items, starting, max_concurrency, lambda: queue.put(1)))


def run_load(
    target: Target,
    items: list[tuple[Conversation, float]],
    max_concurrency: int = 0,
    processes: int = 1,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestResult], float, list[float]]:
    """Send the whole load; every request's result, the run's duration (from the first
    arrival to the last reply) and each client process's CPU use (a fraction of one core)."""
    if processes <= 1:
        run = run_client(target, items, _soon, max_concurrency, on_done)
        return run.results, run.end - run.start, [run.cpu_fraction]
    ctx = multiprocessing.get_context("spawn")
    queue, go, start_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    caps = [
        max_concurrency // processes + (i < max_concurrency % processes) for i in range(processes)
    ]
    children = [
        ctx.Process(
            target=_child,
            args=(
                target,
                items[i::processes],
                max(caps[i], 1) if max_concurrency else 0,
                queue,
                go,
                start_at,
            ),
            daemon=True,
        )  # fmt: skip
        for i in range(processes)
    ]
    for child in children:
        child.start()
    try:
        ready = 0
        while ready < processes:  # NOTE: the clock starts once every client has connected
            ready += queue.get(timeout=120) == "ready"
        start_at.value = time.monotonic() + 0.05
        go.set()
        runs: list[ClientRun] = []
        while len(runs) < processes:
            try:
                message = queue.get(timeout=1.0)
            except Empty:
                dead = [c.exitcode for c in children if c.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process exited with code {dead[0]}") from None
                continue
            if isinstance(message, ClientRun):
                runs.append(message)
            else:
                on_done()
    finally:
        for child in children:
            child.join(timeout=30)
    results = [r for run in runs for r in run.results]
    return results, max(run.end for run in runs) - start_at.value, [r.cpu_fraction for r in runs]
