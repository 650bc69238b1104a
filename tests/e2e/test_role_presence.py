"""A worker changing role steps out of routing but stays a KV peer (real redis-server, sealed
records): while it drains and hands its streams off, the gateway sends it nothing new, yet a
receiver that first hears from its KV sender then still takes the notification (the sender's
name is vouched for), and a prefill into what was reserved on it still finds its endpoint. Only
`leave` (shutdown, death) ends that."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from splitserve.kv_transfer.nixl_transport import SENDER_FIELD
from splitserve.kv_transfer.nixl_vetting import VouchedSenders
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.registry_conceal import Concealed
from splitserve.roles.switch import RolePresence

SECRET = "cluster-secret-for-the-test"
AGENT = b"decode-0-5f0c1e2d"
ENDPOINT = {"grpc.address": b"127.0.0.1:7001", SENDER_FIELD: Concealed(AGENT)}
OPENED = {"grpc.address": b"127.0.0.1:7001", SENDER_FIELD: AGENT}
# NOTE: no heartbeat runs within a test (its interval is longer): every state is set directly.
TTL_S, INTERVAL_S = 120.0, 60.0


@pytest.fixture
def member(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Registry]:
    reg = Registry(redis_server.url, namespace="role", secret=SECRET)
    yield reg
    reg.close()


@pytest.fixture
def receiver_view(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Registry]:
    """Another member's registry: what a receiver (or the gateway) reads."""
    reg = Registry(redis_server.url, namespace="role", secret=SECRET)
    yield reg
    reg.close()


def _presence(member: Registry, kind: list[str]) -> RolePresence:
    def info() -> WorkerInfo:
        return WorkerInfo("decode-0", kind[0], "127.0.0.1:7000", num_total_blocks=8,
                          block_size=16, kv_transports=("nixl", "grpc"))  # fmt: skip

    return RolePresence(member, info, ttl_s=TTL_S, interval_s=INTERVAL_S, kv_endpoint=ENDPOINT)


def _routed(view: Registry) -> dict[str, str]:
    kinds = ("prefill", "decode", "colocated")
    return {w.worker_id: w.kind for k in kinds for w in view.live_workers(k)}


def test_a_worker_changing_role_is_out_of_routing_but_still_a_kv_peer(member, receiver_view):
    kind = ["decode"]
    presence = _presence(member, kind).start()
    try:
        assert _routed(receiver_view) == {"decode-0": "decode"}
        presence.step_aside()
        assert _routed(receiver_view) == {}  # NOTE: nothing new is sent to it
        assert receiver_view.kv_endpoint("decode-0") == OPENED
        # a receiver that first hears from its sender now (a hand-off of a stream it moves)
        vetting = VouchedSenders(lambda: receiver_view.kv_endpoint_values(SENDER_FIELD))
        assert not vetting.check(AGENT.decode(), b"notification")  # unknown yet: held
        assert vetting.release() == [(AGENT.decode(), b"notification")]
        assert vetting.num_unvouched == 0
        kind[0] = "prefill"
        presence.rejoin("prefill")
        assert _routed(receiver_view) == {"decode-0": "prefill"}
        assert receiver_view.kv_endpoint_values(SENDER_FIELD) == {AGENT}
        presence.step_aside()
        presence.leave()  # NOTE: a worker that stops while changing role is no peer any more
        assert _routed(receiver_view) == {}
        assert receiver_view.kv_endpoint("decode-0") is None
        assert receiver_view.kv_endpoint_values(SENDER_FIELD) == set()
    finally:
        presence.stop()


def test_the_heartbeat_of_a_withdrawn_worker_keeps_its_endpoint_and_restores_a_lost_one(
    member, receiver_view, redis_client
):
    info = WorkerInfo("decode-0", "decode", "127.0.0.1:7000", num_total_blocks=8, block_size=16)
    member.register_worker(info, ttl_s=2.0, kv_endpoint=ENDPOINT)
    member.withdraw_worker("decode", "decode-0")
    member.keep_endpoint("decode-0", TTL_S, ENDPOINT)
    assert redis_client.pttl("role:kv_endpoint:decode-0") > 2000  # NOTE: extended past 2 s
    redis_client.delete("role:kv_endpoint:decode-0")  # Redis lost it (restarted empty)
    assert receiver_view.kv_endpoint_values(SENDER_FIELD) == set()
    member.keep_endpoint("decode-0", TTL_S, ENDPOINT)
    assert receiver_view.kv_endpoint("decode-0") == OPENED
    assert receiver_view.kv_endpoint_values(SENDER_FIELD) == {AGENT}
    assert _routed(receiver_view) == {}  # NOTE: still out of routing
