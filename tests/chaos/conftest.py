"""Chaos fixtures: the end-to-end ones (a real `redis-server` for the session, flushed per
test). Tests here run real stacks and break them on purpose: killed and frozen workers, a
restarted Redis, cancellation storms, hostile input. Each ends with the leak check."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve.launch.up import Stack
from tests.e2e.conftest import redis_client, redis_server, registry
from tests.e2e.harness import running_stack

__all__ = ["calm_stack", "redis_client", "redis_server", "registry"]


@pytest.fixture(scope="package")
def calm_stack(tiny_models) -> Iterator[Stack]:
    """2 prefill + 2 decode workers on the tiny llama (its own redis-server), shared by the
    tests that break no process (hostile input, cancels): each ends with the leak check, so the
    next one starts from a clean stack."""
    with running_stack(tiny_models["llama"], prefill=2, decode=2) as stack:
        yield stack
