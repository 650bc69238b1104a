"""The gateway's routing decision against a real redis-server's prefix index (CPU): what one
request costs the gateway before it picks a worker, by prompt length, and how long a worker's
publish of a long prompt's blocks takes (the index's lag beyond the worker's housekeeping turn,
every heartbeat_ttl_s / 6: 0.25 s by default).

Decision = the prompt's chained block hashes, the registry lookup of both tiers
(`prefix_match_tiers`, one round trip), the scores and the policy's pick, as
`Orchestrator._pick_decode` does. The index holds `--workers` workers, each with
`--prompts` prompts of every length in both tiers; the timed prompts are half hits (the first
half of a held prompt, then new tokens) and half misses.

    python -m bench.routing_index --lengths 1024 8192 32768 --requests 200
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench.common import table, write_results
from splitserve.engine.prefix_hash import prefix_block_hashes
from splitserve.gateway.router import LeastLoadedPrefixAware, prefix_scores
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.registry_prefix import host_tier_id

BLOCK = 16


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128000) for _ in range(length)]


def _worker(i: int) -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"decode-{i}", kind="decode", address="127.0.0.1:1", load=i % 3,
        num_free_blocks=100, num_total_blocks=1000,
    )  # fmt: skip


def populate(registry: Registry, workers: int, prompts: int, length: int) -> dict[str, Any]:
    """Each worker publishes its prompts' blocks in both tiers; the slowest publish is the
    index's lag beyond a housekeeping turn."""
    publish_ms = []
    for w in range(workers):
        for p in range(prompts):
            hashes = prefix_block_hashes(_prompt(1000 * w + p, length), BLOCK)
            for index_id in (f"decode-{w}", host_tier_id(f"decode-{w}")):
                start = time.perf_counter()
                registry.add_prefix_blocks(index_id, hashes)
                publish_ms.append(1e3 * (time.perf_counter() - start))
    return {"blocks per publish": (length - 1) // BLOCK,
            "publish p50 ms": statistics.median(publish_ms),
            "publish max ms": max(publish_ms)}  # fmt: skip


def decisions(registry: Registry, workers: int, prompts: int, length: int, n: int) -> list[float]:
    policy = LeastLoadedPrefixAware()
    infos = [_worker(i) for i in range(workers)]
    rng = random.Random(length)
    times = []
    for r in range(n):
        if r % 2:  # a hit: the first half of a held prompt, then new tokens
            held = _prompt(1000 * rng.randrange(workers) + rng.randrange(prompts), length)
            prompt = held[: length // 2] + _prompt(2 * 10**6 + r, length - length // 2)
        else:
            prompt = _prompt(10**6 + r, length)
        start = time.perf_counter()
        hashes = prefix_block_hashes(prompt, BLOCK)
        tiers = registry.prefix_match_tiers(hashes)
        policy.pick_decode(infos, {}, prefix_scores(tiers, 0.9))
        times.append(1e3 * (time.perf_counter() - start))
    return times


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
        try:
            for length in args.lengths:
                row: dict[str, Any] = {"prompt tokens": length}
                row |= populate(registry, args.workers, args.prompts, length)
                times = sorted(decisions(registry, args.workers, args.prompts, length,
                                         args.requests))  # fmt: skip
                row |= {"decision p50 ms": statistics.median(times),
                        "decision p99 ms": times[int(0.99 * (len(times) - 1))]}  # fmt: skip
                prompt = _prompt(7, length)
                start = time.perf_counter()
                for _ in range(20):
                    hashes = prefix_block_hashes(prompt, BLOCK)
                row["hashing ms"] = 1e3 * (time.perf_counter() - start) / 20
                # NOTE: seed 7 is decode-0's 8th prompt; 10**7 + 7 no one's (seeds >= 0:
                # random.Random takes an int seed's absolute value)
                for name, seed in (("lookup, miss ms", 10**7 + 7), ("lookup, whole hit ms", 7)):
                    hashes = prefix_block_hashes(_prompt(seed, length), BLOCK)
                    start = time.perf_counter()
                    for _ in range(20):
                        registry.prefix_match_tiers(hashes)
                    row[name] = 1e3 * (time.perf_counter() - start) / 20
                rows.append(row)
        finally:
            registry.close()
    print(table(rows, list(rows[0])))
    results = {"workers": args.workers, "prompts": args.prompts, "rows": rows}
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main()
