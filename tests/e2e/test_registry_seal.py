"""Workers' registry records sealed with the cluster secret (real redis-server): members read
each other's records; a record written or changed by anyone without the secret is ignored and
logged, never routed to."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis

from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry, WorkerInfo

SECRET = "cluster-secret-for-the-test"
ENDPOINT = {"grpc.address": b"127.0.0.1:7001", "nixl.agent": b"\x00\x01binary"}


def worker(worker_id: str, address: str = "127.0.0.1:7000") -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", address, num_free_blocks=8, num_total_blocks=8,
                      block_size=16, kv_transports=("grpc",))  # fmt: skip


@pytest.fixture
def member(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Registry]:
    reg = Registry(redis_server.url, namespace="sealed", secret=SECRET)
    yield reg
    reg.close()


@pytest.fixture
def stranger(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Registry]:
    """Can write to Redis, has no cluster secret (or a wrong one)."""
    reg = Registry(redis_server.url, namespace="sealed", secret="a-guess")
    yield reg
    reg.close()


def test_members_read_each_others_sealed_records(member, redis_server):
    member.register_worker(worker("d0"), ttl_s=30, kv_endpoint=ENDPOINT)
    other = Registry(redis_server.url, namespace="sealed", secret=SECRET)
    try:
        assert other.live_workers("decode") == [worker("d0")]
        assert other.kv_endpoint("d0") == ENDPOINT  # the seal is not part of what is returned
        assert member.heartbeat(worker("d0"), ttl_s=30)  # heartbeats stay sealed
        assert other.live_workers("decode") == [worker("d0")]
    finally:
        other.close()


def test_a_record_written_without_the_secret_is_ignored_and_logged(member, stranger, caplog):
    member.register_worker(worker("d0"), ttl_s=30, kv_endpoint=ENDPOINT)
    stranger.register_worker(worker("fake"), ttl_s=30, kv_endpoint=ENDPOINT)
    with caplog.at_level(logging.WARNING, logger="splitserve.registry"):
        assert member.live_workers("decode") == [worker("d0")]
        assert member.kv_endpoint("fake") is None
        assert member.kv_endpoint("d0") == ENDPOINT
    text = caplog.text
    assert "sealed:worker:decode:fake" in text and "sealed:kv_endpoint:fake" in text
    assert "seal is wrong" in text and "127.0.0.1" not in text  # the key, not the contents


def test_a_changed_field_or_a_missing_seal_is_refused(member, redis_client, caplog):
    member.register_worker(worker("d0"), ttl_s=30, kv_endpoint=ENDPOINT)
    member.register_worker(worker("d1"), ttl_s=30)
    # Someone with the Redis password points a member's record at their own address …
    redis_client.hset("sealed:worker:decode:d0", "address", "10.0.0.66:50051")
    redis_client.hset("sealed:kv_endpoint:d0", "grpc.address", "10.0.0.66:7001")
    # … or strips the seal off another.
    redis_client.hdel("sealed:worker:decode:d1", "mac")
    with caplog.at_level(logging.WARNING, logger="splitserve.registry"):
        assert member.live_workers("decode") == []
        assert member.kv_endpoint("d0") is None
    assert "seal is missing" in caplog.text and "seal is wrong" in caplog.text


def test_without_a_secret_records_are_taken_as_they_are(redis_server, redis_client):
    plain = Registry(redis_server.url, namespace="sealed")
    try:
        plain.register_worker(worker("d0"), ttl_s=30, kv_endpoint=ENDPOINT)
        assert "mac" not in redis_client.hgetall("sealed:worker:decode:d0")
        assert plain.live_workers("decode") == [worker("d0")]
        assert plain.kv_endpoint("d0") == ENDPOINT
    finally:
        plain.close()


def test_a_bad_record_is_logged_once_not_on_every_read(member, stranger, caplog):
    stranger.register_worker(worker("fake"), ttl_s=30)
    with caplog.at_level(logging.WARNING, logger="splitserve.registry"):
        for _ in range(5):  # the gateway reads the records for every request
            assert member.live_workers("decode") == []
    assert caplog.text.count("sealed:worker:decode:fake") == 1
