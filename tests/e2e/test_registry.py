"""The Redis block-ownership registry against a real redis-server: discovery, leases, fencing,
the prefix index, and the server fixture itself."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from splitserve.kv_transfer.redis_server import RedisServer, find_redis_server
from splitserve.kv_transfer.registry import (
    BlockSizeMismatch,
    Registry,
    RegistryError,
    StaleFenceError,
    WorkerInfo,
)

TTL_S = 0.3
LEASE_S = 5.0


def decode_worker(worker_id: str = "d0", **kw: int) -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", f"127.0.0.1:{len(worker_id)}", **kw)


def chain(n: int) -> list[bytes]:
    return [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]


# -- workers ----------------------------------------------------------------------------------


def test_registered_worker_is_visible_then_expires_without_heartbeats(
    registry: Registry, redis_client: redis.Redis
) -> None:
    info = decode_worker(load=3, num_free_blocks=10, num_total_blocks=16)
    registry.register_worker(info, ttl_s=TTL_S)
    assert registry.live_workers("decode") == [info]
    assert registry.live_workers("prefill") == []
    time.sleep(TTL_S + 0.15)
    assert registry.live_workers("decode") == []
    # The expired id was pruned from the kind's set, not only hidden.
    assert redis_client.smembers("test:workers:decode") == set()


def test_heartbeats_keep_a_worker_alive_and_update_its_load(registry: Registry) -> None:
    registry.register_worker(decode_worker(load=0), ttl_s=TTL_S)
    for load in range(1, 7):  # 0.6 s in all: twice the TTL
        time.sleep(0.1)
        registry.heartbeat(decode_worker(load=load), ttl_s=TTL_S)
    assert registry.live_workers("decode") == [decode_worker(load=6)]


def test_a_worker_with_another_block_size_is_refused_at_registration(registry: Registry) -> None:
    registry.register_worker(decode_worker("d0", block_size=16), ttl_s=LEASE_S)
    prefill = WorkerInfo("p0", "prefill", "127.0.0.1:9", block_size=32)
    with pytest.raises(BlockSizeMismatch, match="block_size 32.*d0 uses 16"):
        registry.register_worker(prefill, ttl_s=LEASE_S)
    assert registry.live_workers("prefill") == []
    registry.register_worker(WorkerInfo("p1", "prefill", "127.0.0.1:9", block_size=16), LEASE_S)
    assert [w.worker_id for w in registry.live_workers("prefill")] == ["p1"]


def test_deregistered_worker_disappears_at_once(registry: Registry) -> None:
    registry.register_worker(decode_worker("d0"), ttl_s=LEASE_S)
    registry.register_worker(decode_worker("d1"), ttl_s=LEASE_S)
    registry.deregister_worker("decode", "d0")
    assert [w.worker_id for w in registry.live_workers("decode")] == ["d1"]


def test_namespaces_do_not_see_each_other(registry: Registry, redis_client: redis.Redis) -> None:
    # from_client over a decode_responses=True client: the registry copes with str replies too.
    other = Registry.from_client(redis_client, namespace="other")
    registry.register_worker(decode_worker(), ttl_s=LEASE_S)
    other.register_worker(decode_worker("d1"), ttl_s=LEASE_S)
    res = other.reserve("r1", "d1", [1], LEASE_S)
    other.begin_write("r1", "p0", res.fence, LEASE_S)
    assert [w.worker_id for w in other.live_workers("decode")] == ["d1"]
    assert [w.worker_id for w in registry.live_workers("decode")] == ["d0"]
    assert registry.get_record("r1") is None
    rec = other.get_record("r1")
    assert rec is not None and (rec.state, rec.block_ids) == ("writing", (1,))
    assert registry.request_record_keys() == []


# -- block records: life cycle, leases, fencing -------------------------------------------------


def test_full_life_cycle_leaves_no_request_keys(registry: Registry) -> None:
    res = registry.reserve("r1", "d0", [4, 5, 6], lease_s=LEASE_S)
    rec = registry.get_record("r1")
    assert rec is not None
    assert (rec.state, rec.owner, rec.writer, rec.fence) == ("reserved", "d0", "", res.fence)
    assert rec.block_ids == (4, 5, 6) and rec.ttl_ms is not None and 0 < rec.ttl_ms <= 5000

    registry.begin_write("r1", "p0", res.fence, lease_s=LEASE_S)
    registry.begin_write("r1", "p0", res.fence, lease_s=LEASE_S)  # a retry by the same writer
    assert registry.renew("r1", res.fence, lease_s=LEASE_S)
    rec = registry.get_record("r1")
    assert rec is not None and (rec.state, rec.writer) == ("writing", "p0")

    registry.handoff("r1", "d0", res.fence, lease_s=LEASE_S)
    registry.handoff("r1", "d0", res.fence, lease_s=LEASE_S)  # idempotent
    rec = registry.get_record("r1")
    assert rec is not None and (rec.state, rec.owner) == ("owned", "d0")
    assert rec.ttl_ms is not None  # an owned record still lapses if D dies

    assert registry.release("r1", res.fence)
    assert not registry.release("r1", res.fence)
    assert registry.get_record("r1") is None
    assert registry.request_record_keys() == []


def test_reserving_a_request_twice_is_refused_unless_replacing(registry: Registry) -> None:
    first = registry.reserve("r1", "d0", [1], LEASE_S)
    with pytest.raises(RegistryError, match="already has a block record"):
        registry.reserve("r1", "d0", [2], LEASE_S)
    second = registry.reserve("r1", "d1", [2], LEASE_S, replace=True)
    assert second.fence > first.fence
    rec = registry.get_record("r1")
    assert rec is not None and (rec.owner, rec.block_ids) == ("d1", (2,))


def test_stale_fence_is_refused_at_begin_write_and_handoff_after_a_replace(
    registry: Registry,
) -> None:
    old = registry.reserve("r1", "d0", [1, 2], LEASE_S)
    registry.begin_write("r1", "p0", old.fence, LEASE_S)
    new = registry.reserve("r1", "d0", [1, 2], LEASE_S, replace=True)

    with pytest.raises(StaleFenceError, match=f"fence {new.fence}") as err:
        registry.begin_write("r1", "p0", old.fence, LEASE_S)
    assert err.value.reason == "fence"
    with pytest.raises(StaleFenceError) as err:
        registry.handoff("r1", "d0", old.fence, LEASE_S)
    assert err.value.reason == "fence"
    assert not registry.renew("r1", old.fence, LEASE_S)
    assert not registry.release("r1", old.fence)

    rec = registry.get_record("r1")
    assert rec is not None and (rec.state, rec.writer, rec.fence) == ("reserved", "", new.fence)
    registry.begin_write("r1", "p1", new.fence, LEASE_S)
    registry.handoff("r1", "d0", new.fence, LEASE_S)
    assert registry.release("r1", new.fence)


def test_steps_on_a_missing_or_finished_record_are_refused(registry: Registry) -> None:
    # NOTE: a fence this Redis issued: an older one would be a record lost in a restart.
    fence = registry.reserve("other", "d0", [0], LEASE_S).fence
    with pytest.raises(StaleFenceError, match="gone") as err:
        registry.begin_write("nope", "p0", fence, LEASE_S)
    assert err.value.reason == "missing"
    with pytest.raises(StaleFenceError):
        registry.handoff("nope", "d0", fence, LEASE_S)
    assert not registry.renew("nope", fence, LEASE_S)

    res = registry.reserve("r1", "d0", [1], LEASE_S)
    registry.handoff("r1", "d0", res.fence, LEASE_S)  # nothing to write: a full prefix hit
    with pytest.raises(StaleFenceError) as err:
        registry.begin_write("r1", "p0", res.fence, LEASE_S)
    assert err.value.reason == "state"
    with pytest.raises(RegistryError, match="reserved on 'd0'"):
        registry.handoff("r1", "d9", res.fence, LEASE_S)


def test_a_holder_whose_reservation_lapsed_owns_it_again_at_handoff(registry: Registry) -> None:
    """A decode worker that still holds the blocks when its Decode comes after the lease ran out
    (an overloaded host) writes the record again, owned under its fence; without the blocks the
    hand-off is refused as before, and a record another reserve holds is never overwritten."""
    res = registry.reserve("late", "d0", [4, 5], lease_s=TTL_S)
    time.sleep(TTL_S + 0.15)
    assert registry.get_record("late") is None
    with pytest.raises(StaleFenceError) as err:
        registry.handoff("late", "d0", res.fence, LEASE_S)
    assert err.value.reason == "missing"
    assert registry.handoff("late", "d0", res.fence, LEASE_S, held=[4, 5]) is True
    rec = registry.get_record("late")
    assert rec is not None
    assert (rec.state, rec.owner, rec.fence, rec.block_ids) == ("owned", "d0", res.fence, (4, 5))
    assert rec.ttl_ms is not None and 0 < rec.ttl_ms <= 5000
    # present: an ordinary (idempotent) hand-off
    assert registry.handoff("late", "d0", res.fence, LEASE_S, held=[4, 5]) is False
    assert registry.renew("late", res.fence, LEASE_S)

    old = registry.reserve("taken", "d0", [1], lease_s=TTL_S)
    time.sleep(TTL_S + 0.15)
    new = registry.reserve("taken", "d1", [2], LEASE_S)
    with pytest.raises(StaleFenceError) as err:
        registry.handoff("taken", "d0", old.fence, LEASE_S, held=[1])
    assert err.value.reason == "fence"
    rec = registry.get_record("taken")
    assert rec is not None and (rec.owner, rec.fence, rec.block_ids) == ("d1", new.fence, (2,))


def run_together(*targets: Callable[[], None]) -> None:
    """Run each target in its own thread, released at the same instant."""
    barrier = threading.Barrier(len(targets))

    def released(target: Callable[[], None]) -> None:
        barrier.wait()
        target()

    threads = [threading.Thread(target=released, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def race_begin_write(registry: Registry, request_id: str, fence: int) -> dict[str, str]:
    """Two prefill workers call begin_write with the same fence at once; their outcomes."""
    outcomes: dict[str, str] = {}

    def write(writer: str) -> None:
        try:
            registry.begin_write(request_id, writer, fence, LEASE_S)
            outcomes[writer] = "ok"
        except StaleFenceError as e:
            outcomes[writer] = e.reason

    run_together(lambda: write("p0"), lambda: write("p1"))
    return outcomes


def race_replace(registry: Registry, request_id: str, old_fence: int) -> tuple[list[str], int]:
    """A writer holding `old_fence` runs begin_write then handoff while the gateway replaces the
    reservation; the writer's successful steps and the new fence."""
    steps: list[str] = []
    new_fence: list[int] = []

    def stale_writer() -> None:
        try:
            registry.begin_write(request_id, "p0", old_fence, LEASE_S)
            steps.append("begin_write")
            registry.handoff(request_id, "d0", old_fence, LEASE_S)
            steps.append("handoff")
        except StaleFenceError:
            pass

    def replacer() -> None:
        new_fence.append(registry.reserve(request_id, "d0", [1], LEASE_S, replace=True).fence)

    run_together(stale_writer, replacer)
    return steps, new_fence[0]


def test_concurrent_begin_write_from_two_writers_has_exactly_one_winner(
    registry: Registry,
) -> None:
    for round_no in range(25):
        res = registry.reserve(f"r{round_no}", "d0", [1], LEASE_S)
        outcomes = race_begin_write(registry, res.request_id, res.fence)
        assert sorted(outcomes.values()) == ["ok", "writer"], outcomes
        (winner,) = [w for w, outcome in outcomes.items() if outcome == "ok"]
        rec = registry.get_record(res.request_id)
        assert rec is not None and (rec.state, rec.writer) == ("writing", winner)


def test_a_writer_racing_a_replace_never_outlives_its_fence(registry: Registry) -> None:
    for round_no in range(25):
        old = registry.reserve(f"r{round_no}", "d0", [1], LEASE_S)
        steps, new_fence = race_replace(registry, old.request_id, old.fence)
        # Whatever the interleaving, the replace wins in the end: the record carries the new
        # fence, in its fresh state, and the old writer's steps form a prefix of its sequence.
        rec = registry.get_record(old.request_id)
        assert rec is not None
        assert (rec.fence, rec.state, rec.writer) == (new_fence, "reserved", "")
        assert steps in ([], ["begin_write"], ["begin_write", "handoff"])


# -- prefix index -------------------------------------------------------------------------------


def test_prefix_match_counts_only_leading_consecutive_hashes(registry: Registry) -> None:
    h = chain(5)
    registry.add_prefix_blocks("a", [h[0], h[1], h[2], h[4]])
    registry.add_prefix_blocks("b", [h[1], h[2], h[3]])  # misses the first block
    registry.add_prefix_blocks("c", [h[0], h[2]])
    assert registry.prefix_match(h) == {"a": 3, "c": 1}
    assert registry.prefix_match(h[:1]) == {"a": 1, "c": 1}
    assert registry.prefix_match([]) == {}
    registry.remove_prefix_blocks("a", [h[1]])
    assert registry.prefix_match(h) == {"a": 1, "c": 1}


def test_clear_prefix_blocks_removes_a_worker_entirely(
    registry: Registry, redis_client: redis.Redis
) -> None:
    h = chain(3)
    registry.add_prefix_blocks("a", h)
    registry.add_prefix_blocks("b", h[:2])
    assert registry.clear_prefix_blocks("a") == 3
    assert registry.prefix_match(h) == {"b": 2}
    assert sorted(redis_client.scan_iter("test:prefix*")) == sorted(
        [f"test:prefix:{x.hex()}" for x in h[:2]] + ["test:prefix_worker:b"]
    )
    assert registry.clear_prefix_blocks("a") == 0


def test_prefix_blocks_of_workers_that_are_gone_are_dropped(registry: Registry) -> None:
    h = chain(3)
    registry.add_prefix_blocks("live", h)
    registry.add_prefix_blocks("dead", h[:2])
    registry.add_prefix_blocks("odd*[id]", h[:1])  # glob characters in an id
    assert registry.prefix_index_workers() == {"live", "dead", "odd*[id]"}
    assert registry.drop_stale_prefix_blocks(["live"]) == ["dead", "odd*[id]"]
    assert registry.prefix_index_workers() == {"live"}
    assert registry.prefix_match(h) == {"live": 3}
    assert registry.drop_stale_prefix_blocks(["live"]) == []


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    holdings=st.dictionaries(
        st.sampled_from(["w0", "w1", "w2"]), st.sets(st.integers(0, 7)), max_size=3
    ),
    query_len=st.integers(0, 8),
)
def test_prefix_match_agrees_with_a_plain_model(
    registry: Registry, holdings: dict[str, set[int]], query_len: int
) -> None:
    h = chain(8)
    for worker in ("w0", "w1", "w2"):
        registry.clear_prefix_blocks(worker)
    for worker, held in holdings.items():
        registry.add_prefix_blocks(worker, [h[i] for i in held])
    expected = {}
    for worker, held in holdings.items():
        n = 0
        while n < query_len and n in held:
            n += 1
        if n:
            expected[worker] = n
    assert registry.prefix_match(h[:query_len]) == expected


# -- the server itself --------------------------------------------------------------------------


def test_redis_servers_start_on_distinct_free_ports_and_stop_kills_the_process(
    redis_server: RedisServer,
) -> None:
    assert os.access(find_redis_server(), os.X_OK)
    with RedisServer() as one, RedisServer() as two:
        assert len({one.port, two.port, redis_server.port}) == 3
        assert one.url == f"redis://127.0.0.1:{one.port}/0"
        for server in (one, two):
            client = redis.Redis.from_url(server.url)
            assert client.ping()
            client.close()
        pid, port = one.pid, one.port
        assert pid is not None
        one.stop()
        one.stop()  # idempotent
        assert one.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        gone = redis.Redis(port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.ConnectionError):
            gone.ping()
        gone.close()
        client = redis.Redis(port=two.port, socket_connect_timeout=1)
        assert client.ping()  # the other instance is untouched
        client.close()


def test_a_server_that_cannot_start_fails_with_its_output() -> None:
    with pytest.raises(RuntimeError, match="exited with code 1 before answering PING"):
        RedisServer(executable="false")
