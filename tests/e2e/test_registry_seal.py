"""Workers' registry records sealed with the cluster secret (real redis-server): members read
each other's records; a record written or changed by anyone without the secret is ignored and
logged, never routed to. Fields that grant access are ciphertext in Redis: only members read
them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis

from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.registry_conceal import Concealed
from splitserve.kv_transfer.registry_seal import Seal

SECRET = "cluster-secret-for-the-test"
ENDPOINT = {"grpc.address": b"127.0.0.1:7001", "nixl.agent": b"\x00\x01binary"}
METADATA = b"nixlSerDes|Agent|d0-agent|UCX|worker address and remote keys \x00\xff"
CONCEALED = {**ENDPOINT, "nixl.metadata": Concealed(METADATA)}


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


def test_without_a_secret_records_are_taken_as_they_are(redis_server, redis_client, member):
    plain = Registry(redis_server.url, namespace="sealed")
    try:
        plain.register_worker(worker("d0"), ttl_s=30, kv_endpoint=CONCEALED)
        assert "mac" not in redis_client.hgetall("sealed:worker:decode:d0")
        assert set(redis_client.hkeys("sealed:kv_endpoint:d0")) == set(CONCEALED)  # in clear
        assert plain.live_workers("decode") == [worker("d0")]
        assert plain.kv_endpoint("d0") == CONCEALED
        # A member's concealed record is no use to a process without the secret.
        member.register_worker(worker("d1"), ttl_s=30, kv_endpoint=CONCEALED)
        assert plain.kv_endpoint("d1") is None
    finally:
        plain.close()


def test_a_bad_record_is_logged_once_not_on_every_read(member, stranger, caplog):
    stranger.register_worker(worker("fake"), ttl_s=30)
    with caplog.at_level(logging.WARNING, logger="splitserve.registry"):
        for _ in range(5):  # the gateway reads the records for every request
            assert member.live_workers("decode") == []
    assert caplog.text.count("sealed:worker:decode:fake") == 1


@pytest.fixture
def raw(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """Redis as anyone with its password sees it (bytes, no cluster secret)."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_a_concealed_field_is_ciphertext_in_redis_and_members_read_it(member, raw, redis_server):
    member.register_worker(worker("d0"), ttl_s=30, kv_endpoint=CONCEALED)
    stored = raw.hgetall("sealed:kv_endpoint:d0")
    assert b"nixl.metadata" not in stored
    ciphertext = stored[b"concealed:nixl.metadata"]
    assert len(ciphertext) == 12 + len(METADATA) + 16  # nonce, ciphertext, tag
    assert not any(METADATA in v or b"nixlSerDes" in v or b"d0-agent" in v for v in stored.values())
    assert stored[b"grpc.address"] == b"127.0.0.1:7001"  # what grants nothing stays readable
    other = Registry(redis_server.url, namespace="sealed", secret=SECRET)
    try:
        assert other.kv_endpoint("d0") == {**ENDPOINT, "nixl.metadata": METADATA}
    finally:
        other.close()
    member.register_worker(worker("d0"), ttl_s=30, kv_endpoint=CONCEALED)  # a fresh nonce
    assert raw.hget("sealed:kv_endpoint:d0", "concealed:nixl.metadata") != ciphertext


def test_a_changed_ciphertext_makes_the_record_ignored_even_resealed(member, raw, caplog):
    member.register_worker(worker("d0"), ttl_s=30, kv_endpoint=CONCEALED)
    member.register_worker(worker("d1"), ttl_s=30, kv_endpoint=CONCEALED)
    for worker_id in ("d0", "d1"):
        key = f"sealed:kv_endpoint:{worker_id}"
        stored = raw.hgetall(key)
        changed = bytearray(stored[b"concealed:nixl.metadata"])
        changed[20] ^= 1
        raw.hset(key, "concealed:nixl.metadata", bytes(changed))
    # d1's seal made anew over the changed field (as if by someone holding the seal's key
    # alone): its ciphertext still does not decrypt.
    key = "sealed:kv_endpoint:d1"
    fields = {k.decode(): v for k, v in raw.hgetall(key).items() if k != b"mac"}
    raw.hset(key, "mac", Seal(SECRET).seal(key, fields)["mac"])
    # Moving a valid ciphertext to another record does not open either.
    member.register_worker(worker("d2"), ttl_s=30, kv_endpoint=CONCEALED)
    member.register_worker(worker("d3"), ttl_s=30, kv_endpoint=CONCEALED)
    moved = raw.hget("sealed:kv_endpoint:d2", "concealed:nixl.metadata")
    key = "sealed:kv_endpoint:d3"
    raw.hset(key, "concealed:nixl.metadata", moved)
    fields = {k.decode(): v for k, v in raw.hgetall(key).items() if k != b"mac"}
    raw.hset(key, "mac", Seal(SECRET).seal(key, fields)["mac"])
    with caplog.at_level(logging.WARNING, logger="splitserve.registry"):
        for _ in range(3):
            assert [member.kv_endpoint(w) for w in ("d0", "d1", "d3")] == [None] * 3
            assert member.kv_endpoint("d2") == {**ENDPOINT, "nixl.metadata": METADATA}
    text = caplog.text
    assert "sealed:kv_endpoint:d0" in text and "seal is wrong" in text
    assert text.count("'nixl.metadata' does not decrypt") == 2  # d1 and d3, once each
    assert "nixlSerDes" not in text


def test_live_members_vouch_for_values_strangers_and_leavers_do_not(
    member, stranger, redis_server
):
    vouched = {"nixl.sender": Concealed(b"prefill-0-0123")}
    member.register_worker(WorkerInfo("p0", "prefill", "127.0.0.1:1"), 30, vouched)
    member.register_worker(worker("d0"), ttl_s=30, kv_endpoint=CONCEALED)
    stranger.register_worker(
        WorkerInfo("p1", "prefill", "127.0.0.1:2"), 30, {"nixl.sender": Concealed(b"fake")}
    )
    assert member.kv_endpoint_values("nixl.sender") == {b"prefill-0-0123"}
    member.deregister_worker("prefill", "p0")
    assert member.kv_endpoint_values("nixl.sender") == set()


def test_a_workers_heartbeat_rewrites_its_record_changed_by_someone_else(
    member, redis_client, caplog
):
    member.register_worker(worker("d0"), ttl_s=30, kv_endpoint=ENDPOINT)
    assert member.heartbeat(worker("d0"), ttl_s=30)  # its own writes alone: nothing to say
    assert "changed by someone else" not in caplog.text
    # someone with Redis's password: a changed field, an added one, a replaced endpoint
    redis_client.hset("sealed:worker:decode:d0", mapping={"address": "10.0.0.9:1", "x": "1"})
    redis_client.delete("sealed:kv_endpoint:d0")
    redis_client.hset("sealed:kv_endpoint:d0", "grpc.address", "10.0.0.9:1")
    assert member.live_workers("decode") == [] and member.kv_endpoint("d0") is None
    with caplog.at_level(logging.WARNING):
        assert member.heartbeat(worker("d0"), ttl_s=30)
    assert "'sealed:worker:decode:d0' was changed by someone else" in caplog.text
    assert "'sealed:kv_endpoint:d0' was changed by someone else" in caplog.text
    assert member.live_workers("decode") == [worker("d0")]
    assert member.kv_endpoint("d0") == ENDPOINT
    assert redis_client.pttl("sealed:kv_endpoint:d0") > 0
