"""The gateway follows the registry's prefix index in memory (gateway/prefix_follower.py), from
its change log, against a real redis-server: the workers' publishes, evictions and clears reach
it; it starts from the sets with nothing missed; it reads them again after a gap (it fell behind
the trimmed log, or Redis lost its data); only live workers count; and while it is not in step
it says so (the router then asks Redis), never answering from a stale copy."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
import redis

from splitserve.engine import SamplingParams
from splitserve.engine.prefix_hash import prefix_block_hashes
from splitserve.gateway.orchestrator import Orchestrator, OrchestratorSettings
from splitserve.gateway.prefix_follower import PrefixFollower, live_ids
from splitserve.gateway.router import make_policy
from splitserve.gateway.validation import Job
from splitserve.kv_transfer import prefix_events
from splitserve.kv_transfer.prefix_events import PrefixEventLog
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry, WorkerInfo

BS = 16
TOKENS = [random.Random(0).randrange(50_000) for _ in range(1601)]
H = prefix_block_hashes(TOKENS, BS)  # 100 blocks


def events(url: str) -> PrefixEventLog:
    return PrefixEventLog(redis.Redis.from_url(url), "test")


@pytest.fixture
def follow(redis_server: RedisServer, registry: Registry) -> Iterator[PrefixFollower]:
    follower = PrefixFollower(events(redis_server.url), None, block_ms=50).start()
    yield follower
    follower.stop()


def caught_up(follower: PrefixFollower, client: redis.Redis) -> None:
    """Wait until the follower applied everything logged so far."""
    url = client.connection_pool.connection_kwargs
    log = PrefixEventLog(redis.Redis(host=url["host"], port=url["port"]), "test")
    try:
        assert follower.wait_applied(log.head(), timeout_s=5.0)
    finally:
        log.close()


def test_publishes_evictions_and_clears_reach_the_gateway(
    follow: PrefixFollower, registry: Registry, redis_client: redis.Redis
) -> None:
    registry.add_prefix_blocks("d0", H[:60])
    registry.add_prefix_blocks("d0@host", H[:90])
    registry.add_prefix_blocks("d1@host", H[:30])
    caught_up(follow, redis_client)
    want = {"d0": (60, 90), "d1": (0, 30)}
    assert follow.match_tiers(TOKENS, BS) == want == registry.prefix_match_tiers(H)
    registry.remove_prefix_blocks("d0", H[20:60])  # the GPU evicts; the host tier keeps them
    caught_up(follow, redis_client)
    assert follow.match_tiers(TOKENS, BS) == {"d0": (20, 90), "d1": (0, 30)}
    registry.clear_prefix_blocks("d0")  # it died: the gateway moved its streams and cleared it
    caught_up(follow, redis_client)
    assert follow.match_tiers(TOKENS, BS) == {"d1": (0, 30)} == registry.prefix_match_tiers(H)
    # A sweep of workers gone from the registry clears both tiers too
    registry.drop_stale_prefix_blocks([])
    caught_up(follow, redis_client)
    assert follow.match_tiers(TOKENS, BS) == {}
    assert follow.view.entries() == {}


def test_it_starts_from_the_sets_and_misses_nothing_published_meanwhile(
    redis_server: RedisServer, registry: Registry, redis_client: redis.Redis
) -> None:
    registry.add_prefix_blocks("d0", H[:50])  # before the gateway started
    follower = PrefixFollower(events(redis_server.url), None, block_ms=50)
    try:
        follower._step()  # NOTE: the thread's first turn, here: head, sets, the entries after
        assert follower.in_step() and follower.rebuilds == 1
        assert follower.match_tiers(TOKENS, BS) == {"d0": (50, 50)}
        follower.start()
        registry.add_prefix_blocks("d1", H[:10])
        registry.remove_prefix_blocks("d0", H[40:])
        caught_up(follower, redis_client)
        assert follower.match_tiers(TOKENS, BS) == {"d0": (40, 40), "d1": (10, 10)}
    finally:
        follower.stop()


def test_a_gap_in_the_log_makes_it_read_the_sets_again(
    redis_server: RedisServer,
    registry: Registry,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefix_events, "EVENTS_MAXLEN", 50)
    follower = PrefixFollower(events(redis_server.url), None, block_ms=50)
    follower._step()
    registry.add_prefix_blocks("d0", H[:80])
    for i in range(300):  # far more changes than the log keeps: the follower misses some
        registry.add_prefix_blocks(f"w{i % 3}", [H[99 - i % 20]])
    registry.remove_prefix_blocks("d0", H[70:])
    follower._step()
    assert not follower.in_step()  # it noticed: no answer from a copy that missed changes
    assert follower.match_tiers(TOKENS, BS) is None
    follower._step()
    assert follower.rebuilds == 2 and follower.in_step()
    assert follower.match_tiers(TOKENS, BS) == {"d0": (70, 70)} == registry.prefix_match_tiers(H)
    # Redis lost its data (and the log with it): the workers publish again from nothing
    redis_client.flushdb()
    registry.add_prefix_blocks("d1", H[:5])
    follower._step()
    assert follower.match_tiers(TOKENS, BS) is None
    follower._step()
    assert follower.rebuilds == 3
    assert follower.match_tiers(TOKENS, BS) == {"d1": (5, 5)}
    follower.stop()


def test_only_live_workers_count(
    redis_server: RedisServer, registry: Registry, redis_client: redis.Redis
) -> None:
    registry.register_worker(WorkerInfo("d0", "decode", "127.0.0.1:1"), ttl_s=30.0)
    registry.register_worker(WorkerInfo("p0", "prefill", "127.0.0.1:2"), ttl_s=30.0)
    registry.add_prefix_blocks("d0", H[:10])
    registry.add_prefix_blocks("p0@host", H[:20])
    registry.add_prefix_blocks("dead", H[:30])  # died without leaving: not yet swept
    follower = PrefixFollower(
        events(redis_server.url), live_ids(registry), block_ms=50, live_every_s=0.05
    ).start()
    try:
        caught_up(follower, redis_client)
        assert follower.match_tiers(TOKENS, BS) == {"d0": (10, 10), "p0": (0, 20)}
        registry.deregister_worker("decode", "d0")  # gone from the registry
        deadline = time.monotonic() + 5.0
        while follower.match_tiers(TOKENS, BS) != {"p0": (0, 20)}:
            assert time.monotonic() < deadline, follower.match_tiers(TOKENS, BS)
            time.sleep(0.01)
    finally:
        follower.stop()


def test_while_redis_does_not_answer_it_answers_nothing() -> None:
    with RedisServer() as server:
        registry = Registry(server.url, namespace="test")
        registry.add_prefix_blocks("d0", H[:10])
        follower = PrefixFollower(events(server.url), None, block_ms=50, stale_s=0.5).start()
        deadline = time.monotonic() + 5.0
        while follower.match_tiers(TOKENS, BS) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert follower.match_tiers(TOKENS, BS) == {"d0": (10, 10)}
        registry.close()
    deadline = time.monotonic() + 5.0
    while follower.match_tiers(TOKENS, BS) is not None:  # Redis stopped
        assert time.monotonic() < deadline, "still answering from a copy Redis cannot confirm"
        time.sleep(0.05)
    follower.stop()


class Routes:
    def routed(self, kind: str, worker_id: str, reason: str) -> None:
        self.last = (worker_id, reason)


def test_the_gateway_routes_from_memory_as_from_redis(
    redis_server: RedisServer, registry: Registry, redis_client: redis.Redis
) -> None:
    for name in ("d0", "d1"):
        registry.register_worker(WorkerInfo(name, "decode", f"127.0.0.1:{len(name)}"), ttl_s=30.0)
    registry.add_prefix_blocks("d1", H[:40])
    registry.add_prefix_blocks("d0@host", H[:60])
    follower = PrefixFollower(events(redis_server.url), live_ids(registry), block_ms=50)
    settings = OrchestratorSettings(block_size=BS)
    from_redis = Orchestrator(registry, make_policy("least-loaded-prefix"), settings)
    from_memory = Orchestrator(
        registry, make_policy("least-loaded-prefix"), settings, prefix_index=follower
    )
    job = Job("r", TOKENS, SamplingParams(max_tokens=1), priority=0)
    want = from_redis._pick_decode_now(job, Routes(), ())  # type: ignore[arg-type]
    assert want.cached_blocks == pytest.approx({"d0": 0.9 * 60, "d1": 40})
    # Not in step yet (never started): it asks Redis
    assert from_memory._pick_decode_now(job, Routes(), ()) == want  # type: ignore[arg-type]
    from_memory._count(want.worker.worker_id, -1)  # NOTE: as before: nothing in flight
    follower.start()
    try:
        caught_up(follower, redis_client)
        assert follower.in_step()
        assert from_memory._pick_decode_now(job, Routes(), ()) == want  # type: ignore[arg-type]
        assert (follower.declined, follower.answered) == (1, 1)
    finally:
        follower.stop()
