"""Security fixtures: the end-to-end ones (a real `redis-server` for the session, flushed per
test). Tests here play a stranger on the same network: a caller without the API key, a host
without the cluster secret, a client of Redis without its password; each attack must be refused
and leave the victims' requests as they would have been."""

from __future__ import annotations

from tests.e2e.conftest import redis_client, redis_server, registry

__all__ = ["redis_client", "redis_server", "registry"]
