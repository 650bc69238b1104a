"""End-to-end fixtures: one real `redis-server` process for the session, flushed per test; the
gRPC KV transport's receivers and senders over real pools (`kv_grpc_pools.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
import torch

from splitserve.kv_transfer.grpc_transport import GrpcKVSender
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry
from tests.e2e.kv_grpc_pools import Receiver, make_connector, make_pool, start_receiver


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


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    """Start receivers on demand; every one is stopped at the end of the test."""
    started: list[Receiver] = []

    def start(dtype: torch.dtype = torch.float32, **kwargs: object) -> Receiver:
        started.append(start_receiver(dtype, **kwargs))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for r in started:
        r.server.close()


@pytest.fixture
def receiver(receivers: Callable[..., Receiver]) -> Receiver:
    return receivers()


@pytest.fixture
def senders() -> Iterator[Callable[..., GrpcKVSender]]:
    """Build senders (over their own pools) on demand; all are closed at the end of the test."""
    made: list[GrpcKVSender] = []

    def make(pool: torch.Tensor, cls: type[GrpcKVSender] = GrpcKVSender) -> GrpcKVSender:
        made.append(cls(make_connector(pool)))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def src_pool() -> torch.Tensor:
    return make_pool(seed=1)


@pytest.fixture
def sender(senders: Callable[..., GrpcKVSender], src_pool: torch.Tensor) -> GrpcKVSender:
    return senders(src_pool)
