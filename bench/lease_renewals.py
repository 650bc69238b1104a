"""What a decode worker's lease renewals cost per housekeeping tick (CPU, a real redis-server):
one round trip per running stream (`Registry.renew` each, the old way) against one call for
all of them (`Registry.renew_many`), in alternating rounds over the same records.

    python -m bench.lease_renewals --leases 32 256 1024 --rounds 5 --out /tmp/leases.json

Reported per tick (best of the rounds): wall time and the calling process's CPU time, which
the decode worker's front spends beside its event loop every 0.5 s.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import table, write_results
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry

LEASE_S = 30.0


def _tick(renew: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    renew()
    return 1e3 * (time.perf_counter() - wall), 1e3 * (time.process_time() - cpu)


def one_size(registry: Registry, leases: int, rounds: int) -> list[dict[str, Any]]:
    fences = {f"bench-{i}": registry.reserve(f"bench-{i}", "d0", [i], LEASE_S).fence
              for i in range(leases)}  # fmt: skip
    ways = {
        "one call each": lambda: [registry.renew(r, f, LEASE_S) for r, f in fences.items()],
        "renew_many": lambda: registry.renew_many(fences, LEASE_S),
    }
    try:
        got: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for _ in range(rounds):
            for way, renew in ways.items():
                got[way].append(_tick(renew))
        assert registry.renew_many(fences, LEASE_S) == set(), "a lease was lost"
    finally:
        for request_id, fence in fences.items():
            registry.release(request_id, fence)
    return [
        {"leases": leases, "way": way, "wall_ms": round(min(w for w, _ in t), 3),
         "cpu_ms": round(min(c for _, c in t), 3)}
        for way, t in got.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results/lease_renewals.json")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with RedisServer() as server:
        registry = Registry(server.url)
        try:
            for leases in args.leases:
                rows += one_size(registry, leases, args.rounds)
        finally:
            registry.close()
    print(table(rows, list(rows[0])))
    results = {"rounds": args.rounds, "rows": rows}
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main()
