"""The gateway's routing decision against a real redis-server's prefix index (CPU): what one
request costs the gateway before it picks a worker, by prompt length, from the index the
gateway follows in memory and (the baseline, in the same run) from Redis's Lua lookup; and the
index's lag: from a worker's publish to the change being in the gateway's copy.

Decision, as `Orchestrator._pick_decode_now` makes it (its live-worker reads aside):
- memory: the in-memory walk (`PrefixFollower.match_tiers`: the prompt hashed only as far as
  some worker's run goes, hashes of recently routed prompts reused), then the scores and the
  policy's pick; "no memo": the same, every hash computed;
- Redis: the prompt's chained block hashes, the registry lookup of both tiers
  (`prefix_match_tiers`, one round trip), the scores and the pick (the gateway's path when its
  copy is not in step).

The index holds `--workers` live workers, each with `--prompts` prompts of every length in
both tiers; the timed prompts are half hits (the first half of a held prompt, then new tokens)
and half misses. Both paths answer every prompt, and must agree. "memory cpu" is the memory
path's own CPU time (`time.thread_time`): on a shared VM the wall clock's tail is mostly the
thread waiting for a core.

    python -m bench.routing_index --lengths 1024 8192 32768 --requests 200
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

from bench.common import table, write_results
from splitserve.engine.prefix_hash import prefix_block_hashes
from splitserve.gateway.prefix_follower import PrefixFollower, live_ids
from splitserve.gateway.prompt_chain import PromptChain
from splitserve.gateway.router import LeastLoadedPrefixAware, prefix_scores
from splitserve.kv_transfer.prefix_events import PrefixEventLog
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.registry_prefix import host_tier_id

BLOCK = 16
Tiers = dict[str, tuple[int, int]]


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128000) for _ in range(length)]


def _worker(i: int) -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"decode-{i}", kind="decode", address="127.0.0.1:1", load=i % 3,
        num_free_blocks=100, num_total_blocks=1000,
    )  # fmt: skip


def _ms(times: list[float], q: float) -> float:
    times = sorted(times)
    return times[int(q * (len(times) - 1))]


def populate(
    registry: Registry, follower: PrefixFollower, log: PrefixEventLog, workers: int,
    prompts: int, length: int,
) -> dict[str, Any]:  # fmt: skip
    """Each worker publishes its prompts' blocks in both tiers. Lag: from the publish's
    start until the gateway's copy applied it (the publish's own time included: the copy may
    apply it before the worker has read the MULTI's replies)."""
    publish_ms, lag_ms = [], []
    for w in range(workers):
        for p in range(prompts):
            hashes = prefix_block_hashes(_prompt(1000 * w + p, length), BLOCK)
            for index_id in (f"decode-{w}", host_tier_id(f"decode-{w}")):
                start = time.perf_counter()
                registry.add_prefix_blocks(index_id, hashes)
                done = time.perf_counter()
                publish_ms.append(1e3 * (done - start))
                if not follower.wait_applied(log.head(), timeout_s=10.0):
                    raise RuntimeError("the gateway's copy did not catch up in 10 s")
                lag_ms.append(1e3 * (follower.applied_at - start))
    return {"blocks per publish": (length - 1) // BLOCK,
            "publish p50 ms": statistics.median(publish_ms),
            "publish max ms": max(publish_ms),
            "lag p50 ms": statistics.median(lag_ms), "lag max ms": max(lag_ms)}  # fmt: skip


def decisions(
    lookups: Mapping[str, Callable[[list[int]], Tiers]], workers: int, prompts: int, length: int,
    n: int,
) -> dict[str, list[float]]:  # fmt: skip
    """Each lookup's decision time (ms) on the same prompts, in turn; they must agree."""
    policy = LeastLoadedPrefixAware()
    infos = [_worker(i) for i in range(workers)]
    rng = random.Random(length)
    times: dict[str, list[float]] = {name: [] for name in [*lookups, "memory cpu"]}
    for r in range(n):
        if r % 2:  # a hit: the first half of a held prompt, then new tokens
            held = _prompt(1000 * rng.randrange(workers) + rng.randrange(prompts), length)
            prompt = held[: length // 2] + _prompt(2 * 10**6 + r, length - length // 2)
        else:
            prompt = _prompt(10**6 + r, length)
        answers = []
        order = list(lookups.items())
        turn = r % len(order)  # NOTE: each lookup goes first in turn (caches, the GIL)
        for name, lookup in order[turn:] + order[:turn]:
            start, cpu = time.perf_counter(), time.thread_time()
            tiers = lookup(prompt)
            policy.pick_decode(infos, {}, prefix_scores(tiers, 0.9))
            times[name].append(1e3 * (time.perf_counter() - start))
            if name == "memory":  # NOTE: this thread's CPU time: the wall's, less preemption
                times["memory cpu"].append(1e3 * (time.thread_time() - cpu))
            answers.append(tiers)
        if any(a != answers[0] for a in answers):
            raise AssertionError(f"the lookups disagree on prompt {r}: {answers}")
    return times


def timed(fn: Callable[[], Any], n: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - start) / n


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", default="bench/results/routing_index.json")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with RedisServer() as server:
        registry = Registry(server.url)
        for i in range(args.workers):
            registry.register_worker(_worker(i), ttl_s=3600.0)
        log = PrefixEventLog(redis.Redis.from_url(server.url), registry.namespace)
        follower = PrefixFollower(
            PrefixEventLog(redis.Redis.from_url(server.url), registry.namespace),
            live_ids(registry),
        ).start()

        def from_redis(prompt: list[int]) -> Tiers:
            return registry.prefix_match_tiers(prefix_block_hashes(prompt, BLOCK))

        def from_memory(prompt: list[int]) -> Tiers:
            tiers = follower.match_tiers(prompt, BLOCK)
            if tiers is None:
                raise RuntimeError("the gateway's copy is not in step")
            return tiers

        def no_memo(prompt: list[int]) -> Tiers:
            """The same walk, every hash computed (no recently routed prompt to reuse)."""
            with follower.view.lock:
                return follower.view.match(PromptChain(prompt, BLOCK))

        try:
            for length in args.lengths:
                row: dict[str, Any] = {"prompt tokens": length}
                row |= populate(registry, follower, log, args.workers, args.prompts, length)
                lookups = {"memory": from_memory, "no memo": no_memo, "Redis": from_redis}
                times = decisions(lookups, args.workers, args.prompts, length, args.requests)
                for name, t in times.items():
                    row |= {f"{name} p50 ms": _ms(t, 0.5), f"{name} p99 ms": _ms(t, 0.99)}
                # NOTE: seed 7 is decode-0's 8th prompt; 10**7 + 7 no one's (seeds >= 0:
                # random.Random takes an int seed's absolute value)
                hit, miss = _prompt(7, length), _prompt(10**7 + 7, length)
                row["hashing ms"] = timed(lambda: prefix_block_hashes(hit, BLOCK))  # noqa: B023
                row["memory, miss ms"] = timed(lambda: from_memory(miss))  # noqa: B023
                row["whole hit: no memo ms"] = timed(lambda: no_memo(hit))  # noqa: B023
                row["memo ms"] = timed(lambda: from_memory(hit))  # noqa: B023
                row["Redis ms"] = timed(lambda: from_redis(hit))  # noqa: B023
                rows.append(row)
        finally:
            follower.stop()
            log.close()
            registry.close()
    print(table(rows, list(rows[0])))
    results = {"workers": args.workers, "prompts": args.prompts, "rows": rows,
               "follower rebuilds": follower.rebuilds}  # fmt: skip
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main()
