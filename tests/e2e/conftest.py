"""End-to-end fixtures: one real `redis-server` process for the session, flushed per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, stopped at the end of the session."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on an empty database: every test starts from (and leaves) a flushed DB."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def registry(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Registry]:
    """A registry in the "test" namespace over its own connection pool."""
    reg = Registry(redis_server.url, namespace="test")
    yield reg
    reg.close()
