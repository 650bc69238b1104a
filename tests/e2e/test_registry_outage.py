"""The registry against a Redis that blinks: a real `redis-server` stopped, restarted empty on
the same port, or flushed. Calls retry through short outages and answer UNAVAILABLE after
longer ones, fences never repeat across a restart, lost records are told from lapsed ones and
re-published by their holder, and a worker whose advertisement vanished registers again."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from splitserve.engine.errors import Unavailable
from splitserve.kv_transfer.presence import Presence
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import (
    BlockRecord,
    Registry,
    RegistryUnavailable,
    StaleFenceError,
    WorkerInfo,
)
from splitserve.kv_transfer.registry_records import RecordLost

LEASE_S = 10.0


@pytest.fixture
def server() -> Iterator[list[RedisServer]]:
    """A Redis of the test's own (the list gets the restarted one too; all stopped at the end)."""
    servers = [RedisServer()]
    yield servers
    for s in servers:
        s.stop()


def _restart(servers: list[RedisServer], down_s: float = 0.0) -> None:
    port = servers[-1].port
    servers[-1].stop()
    time.sleep(down_s)
    servers.append(RedisServer(port=port))


def test_fences_after_a_restart_are_greater_than_any_before(server):
    registry = Registry(server[0].url, retry_s=2.0)
    try:
        before = [registry.reserve(f"b{i}", "d0", [i], LEASE_S).fence for i in range(50)]
        assert before == sorted(set(before))
        _restart(server)
        after = [registry.reserve(f"a{i}", "d0", [i], LEASE_S).fence for i in range(50)]
        assert after == sorted(set(after))
        assert min(after) > max(before)
    finally:
        registry.close()


def test_a_call_rides_through_a_short_outage_and_fails_unavailable_after_a_long_one(server):
    registry = Registry(server[0].url, retry_s=3.0)
    try:
        registry.reserve("r1", "d0", [1], LEASE_S)
        port = server[0].port
        server[0].stop()
        threading.Timer(0.5, lambda: server.append(RedisServer(port=port))).start()
        started = time.monotonic()
        assert registry.live_workers("decode") == []  # retried until Redis answered again
        assert 0.4 < time.monotonic() - started < 3.0

        quick = Registry(f"redis://127.0.0.1:{port}/0", retry_s=0.3)
        server[-1].stop()
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="unavailable") as err:
            quick.reserve("r2", "d0", [2], LEASE_S)
        assert isinstance(err.value, Unavailable) and err.value.status == "UNAVAILABLE"
        assert 0.25 < time.monotonic() - started < 2.0
        quick.close()
    finally:
        registry.close()


def test_an_outage_is_logged_once_not_per_call(server, caplog):
    registry = Registry(server[0].url, retry_s=0.0)
    try:
        server[0].stop()
        with caplog.at_level(logging.WARNING, logger="splitserve.kv_transfer.registry"):
            for _ in range(20):
                with pytest.raises(RegistryUnavailable):
                    registry.kv_endpoint("d0")
        assert len(caplog.records) == 1
        assert "Traceback" not in caplog.text and "unreachable" in caplog.text
    finally:
        registry.close()


def test_a_lost_record_waits_for_its_holder_and_a_lapsed_one_is_stale(server):
    registry = Registry(server[0].url, retry_s=0.3)
    try:
        lost = registry.reserve("lost", "d0", [1, 2], LEASE_S)
        _restart(server)
        with pytest.raises(RecordLost):
            registry.begin_write("lost", "p0", lost.fence, LEASE_S)
        released = registry.reserve("released", "d0", [3], LEASE_S)
        registry.release("released", released.fence)
        with pytest.raises(StaleFenceError) as err:
            registry.begin_write("released", "p0", released.fence, LEASE_S)
        assert err.value.reason == "missing"

        held = [
            BlockRecord("lost", "reserved", "d0", "", lost.fence, (1, 2), None),
            BlockRecord("released", "reserved", "d0", "", released.fence, (3,), None),
        ]
        mark, restored = registry.restore(held, LEASE_S)
        assert restored == 1  # the lost one; never the one released after the restart
        registry.begin_write("lost", "p0", lost.fence, LEASE_S)
        registry.handoff("lost", "d0", lost.fence, LEASE_S)
        record = registry.get_record("lost")
        assert record is not None and record.state == "owned" and record.block_ids == (1, 2)

        registry.release("lost", lost.fence)  # it finished: a later call restores nothing
        assert registry.restore(held, LEASE_S, mark) == (mark, 0)
        assert registry.get_record("lost") is None
    finally:
        registry.close()


def test_a_worker_whose_advertisement_vanished_registers_again(server):
    registry = Registry(server[0].url, retry_s=2.0)
    info = WorkerInfo("d0", "decode", "127.0.0.1:1", num_total_blocks=8, block_size=16)
    rejoined = threading.Event()
    presence = Presence(
        registry,
        lambda: info,
        ttl_s=1.0,
        interval_s=0.05,
        kv_endpoint={"grpc": b"127.0.0.1:2"},
        on_rejoin=rejoined.set,
    ).start()
    try:
        _restart(server, down_s=0.3)
        assert rejoined.wait(5)
        deadline = time.monotonic() + 5
        while not registry.live_workers("decode") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [w.worker_id for w in registry.live_workers("decode")] == ["d0"]
        assert registry.kv_endpoint("d0") == {"grpc": b"127.0.0.1:2"}
    finally:
        presence.stop()
        registry.close()
