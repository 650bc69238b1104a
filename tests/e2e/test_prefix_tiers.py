"""A worker's host-memory KV tier in the registry's prefix index, against a real redis-server:
listed under "<worker>@host", matched per tier (`prefix_match_tiers`), and owned by its worker
(cleared when it leaves, restarts or dies; never swept while it is live). Its `PrefixMirror`
publishes both tiers' events apart."""

from __future__ import annotations

import hashlib
from typing import Any

import redis

from splitserve.decode_service.prefix_mirror import PrefixMirror
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.registry_prefix import HOST_TIER_SUFFIX, host_tier_id


def chain(n: int) -> list[bytes]:
    return [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]


H = chain(6)


def test_the_host_tier_id_is_the_worker_id_and_a_suffix() -> None:
    assert host_tier_id("d0") == "d0" + HOST_TIER_SUFFIX == "d0@host"


def test_tiers_are_matched_as_the_engine_takes_them_gpu_first_then_host(
    registry: Registry,
) -> None:
    registry.add_prefix_blocks("gpu", H[:4])
    registry.add_prefix_blocks("gpu@host", H[:5])  # written through: a superset, and one more
    registry.add_prefix_blocks("host@host", H[:3])  # evicted from its GPU, kept on the host
    registry.add_prefix_blocks("mixed", [H[0], H[1], H[4]])
    registry.add_prefix_blocks("mixed@host", [H[2], H[3]])  # the GPU's run goes on here
    registry.add_prefix_blocks("late", H[1:])  # misses the first block in both tiers
    registry.add_prefix_blocks("late@host", H[2:])
    assert registry.prefix_match_tiers(H) == {
        "gpu": (4, 5),
        "host": (0, 3),
        "mixed": (2, 4),  # never back to the GPU's H[4] after the host tier's run
    }
    # GPU-only matching, for callers that want it, is as before: host tiers do not count
    assert registry.prefix_match(H) == {"gpu": 4, "mixed": 2}
    assert registry.prefix_match_tiers(H[:1]) == {"gpu": (1, 1), "host": (0, 1), "mixed": (1, 1)}
    assert registry.prefix_match_tiers([]) == {}


def test_clearing_a_worker_clears_its_host_tier_too(
    registry: Registry, redis_client: redis.Redis
) -> None:
    registry.add_prefix_blocks("a", H[:2])
    registry.add_prefix_blocks("a@host", H[:3])
    registry.add_prefix_blocks("b@host", H[:1])
    assert registry.prefix_index_workers() == {"a", "b"}
    assert registry.clear_prefix_blocks("a") == 5
    assert registry.prefix_match_tiers(H) == {"b": (0, 1)}
    assert sorted(redis_client.scan_iter("test:prefix*")) == sorted(
        [f"test:prefix:{H[0].hex()}", "test:prefix_worker:b@host"]
    )


def test_the_sweep_drops_a_dead_workers_host_tier_and_keeps_a_live_ones(
    registry: Registry,
) -> None:
    registry.add_prefix_blocks("live@host", H[:2])  # nothing on its GPU: still its own
    registry.add_prefix_blocks("dead", H[:1])
    registry.add_prefix_blocks("dead@host", H[:3])
    registry.add_prefix_blocks("gone@host", H[:3])  # only its host tier was left
    assert registry.drop_stale_prefix_blocks(["live"]) == ["dead", "gone"]
    assert registry.prefix_index_workers() == {"live"}
    assert registry.prefix_match_tiers(H) == {"live": (0, 2)}
    assert registry.drop_stale_prefix_blocks(["live"]) == []


class FakeCore:
    """Stands in for the engine core's client: hands out queued prefix events once."""

    def __init__(self) -> None:
        self.events: list[list[Any]] = []

    def call(self, name: str) -> list[list[Any]]:
        assert name == "take_prefix_events"
        events, self.events = self.events, []
        return events


def mirror(registry: Registry, core: FakeCore, worker_id: str = "d0") -> PrefixMirror:
    return PrefixMirror(core, registry, worker_id, sweep_s=0.0)  # type: ignore[arg-type]


def test_the_mirror_publishes_each_tier_under_its_own_id(registry: Registry) -> None:
    core = FakeCore()
    prefix = mirror(registry, core)
    core.events = [[True, h, "gpu"] for h in H[:2]] + [[True, h, "host"] for h in H[:4]]
    prefix.publish()
    assert registry.prefix_match_tiers(H) == {"d0": (2, 4)}
    # The GPU evicts H[1] (the host tier keeps it); the host tier evicts H[3]
    core.events = [[False, H[1], "gpu"], [False, H[3], "host"]]
    prefix.publish()
    assert registry.prefix_match_tiers(H) == {"d0": (1, 3)}


def test_the_mirror_republishes_both_tiers_and_leaving_clears_both(
    registry: Registry, redis_client: redis.Redis
) -> None:
    core = FakeCore()
    prefix = mirror(registry, core)
    core.events = [[True, H[0], "gpu"], [True, H[0], "host"], [True, H[1], "host"]]
    prefix.publish()
    redis_client.flushdb()  # Redis lost its data
    prefix.republish()
    assert registry.prefix_match_tiers(H) == {"d0": (1, 2)}
    prefix.leave()
    assert registry.prefix_match_tiers(H) == {}
    assert registry.prefix_index_workers() == set()


def test_a_restarted_worker_starts_with_neither_tier_indexed(registry: Registry) -> None:
    registry.add_prefix_blocks("d0", H[:2])
    registry.add_prefix_blocks("d0@host", H[:4])  # its last life's
    mirror(registry, FakeCore())
    assert registry.prefix_match_tiers(H) == {}


def test_the_mirrors_sweep_keeps_live_workers_host_tiers(registry: Registry) -> None:
    registry.register_worker(WorkerInfo("d1", "decode", "127.0.0.1:1"), ttl_s=30.0)
    registry.add_prefix_blocks("d1@host", H[:2])
    registry.add_prefix_blocks("dead@host", H[:2])
    core = FakeCore()
    prefix = mirror(registry, core)
    core.events = [[True, H[0], "host"]]
    prefix.publish()  # sweeps: its own entries and live d1's stay, dead's go
    assert registry.prefix_match_tiers(H) == {"d0": (0, 1), "d1": (0, 2)}
