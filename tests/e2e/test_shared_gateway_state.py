"""What gateway replicas share in a real Redis, replica by replica: each prefill worker's prompt
tokens in flight (the budget holds across replicas, and a dead replica's tokens stop counting),
and the owners of request ids (a forwarded Abort, and how long it takes)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from splitserve.engine.errors import AlreadyExists
from splitserve.gateway.admission import PrefillBudget
from splitserve.gateway.prefill_ledger import RedisLedger
from splitserve.gateway.replicas import SharedRequests
from splitserve.kv_transfer.registry import WorkerInfo

WORKER = WorkerInfo(worker_id="prefill-0", kind="prefill", address="127.0.0.1:1")
NS = "test"


def _client(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


def _alive(client: redis.Redis, replica: str, ttl_ms: int = 60_000) -> None:
    client.set(f"{NS}:gw:alive:{replica}", b"1", px=ttl_ms)


async def _candidates() -> list[WorkerInfo]:
    return [WORKER]


def _pick(workers, used):
    return workers[0]


def _budget(redis_server, replica: str) -> PrefillBudget:
    return PrefillBudget(100, ledger=RedisLedger(_client(redis_server), replica, NS))


def test_a_prefill_budget_holds_across_two_gateway_replicas(redis_server, redis_client):
    _alive(redis_client, "a")
    _alive(redis_client, "b")
    a, b = _budget(redis_server, "a"), _budget(redis_server, "b")

    async def scenario() -> float:
        deadline = time.monotonic() + 10
        assert await a.acquire(_candidates, 80, deadline, _pick) is WORKER
        waiting = asyncio.ensure_future(b.acquire(_candidates, 50, deadline, _pick))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # 80 + 50 > 100: B waits although B itself holds nothing
        released = time.monotonic()
        await a.release(WORKER.worker_id, 80)
        assert await asyncio.wait_for(waiting, 5) is WORKER
        woke = time.monotonic() - released
        await b.release(WORKER.worker_id, 50)
        return woke

    woke = asyncio.run(scenario())
    assert woke < 1.0  # B polls the shared count; no release of A's wakes it directly
    assert redis_client.hgetall(f"{NS}:gw:prefill:{WORKER.worker_id}") == {}


def test_an_idle_worker_takes_a_prompt_longer_than_the_budget_from_any_replica(
    redis_server, redis_client
):
    _alive(redis_client, "a")
    a = _budget(redis_server, "a")

    async def scenario() -> None:
        assert await a.acquire(_candidates, 500, time.monotonic() + 5, _pick) is WORKER

    asyncio.run(scenario())


def test_a_dead_replicas_prefill_tokens_stop_counting_when_its_lease_lapses(
    redis_server, redis_client
):
    _alive(redis_client, "dead")
    _alive(redis_client, "b")
    dead, b = _budget(redis_server, "dead"), _budget(redis_server, "b")

    async def scenario() -> None:
        deadline = time.monotonic() + 10
        await dead.acquire(_candidates, 90, deadline, _pick)  # and never released
        waiting = asyncio.ensure_future(b.acquire(_candidates, 50, deadline, _pick))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        redis_client.delete(f"{NS}:gw:alive:dead")  # its lease lapses (it stopped renewing)
        assert await asyncio.wait_for(waiting, 5) is WORKER

    asyncio.run(scenario())


def test_an_abort_forwarded_to_the_owner_replica_is_answered_and_timed(redis_server):
    owner_side = SharedRequests(_client(redis_server), "owner", NS)
    asker = SharedRequests(_client(redis_server), "asker", NS)
    aborted: list[tuple[str, str]] = []

    async def scenario() -> tuple[bool, float, bool]:
        loop = asyncio.get_running_loop()

        def abort_local(request_id: str, who: str) -> bool:
            aborted.append((request_id, who))
            return True

        owner_side.start(loop, abort_local, lambda: ["r1"])
        try:
            assert await asyncio.to_thread(owner_side.claim, "r1", "key-1") is False
            with pytest.raises(AlreadyExists):
                await asyncio.to_thread(asker.claim, "r1", "key-1")
            # NOTE: another API key's Abort finds nothing, as on one replica
            stranger = await asyncio.to_thread(asker.abort_elsewhere, "r1", "key-2")
            await asyncio.sleep(0.6)  # the listener has subscribed
            started = time.monotonic()
            ok = await asyncio.to_thread(asker.abort_elsewhere, "r1", "key-1")
            return ok, time.monotonic() - started, stranger
        finally:
            await asyncio.to_thread(owner_side.stop)

    ok, took, stranger = asyncio.run(scenario())
    assert ok and not stranger
    assert aborted == [("r1", "key-1")]
    assert took < 0.5, f"a forwarded Abort took {took * 1000:.0f} ms"
    asker.stop()


def test_while_redis_is_down_a_replica_acts_alone_and_asks_again_later():
    from splitserve.kv_transfer.redis_server import RedisServer

    server = RedisServer()
    port = server.port
    client = redis.Redis.from_url(server.url, socket_connect_timeout=1.0)
    patient = SharedRequests(client, "patient", NS, outage_retry_s=60.0)
    eager = SharedRequests(client, "eager", NS, outage_retry_s=0.2)
    server.stop()
    assert patient.claim("r1", "key") is False  # Redis down: served alone, not refused
    assert eager.claim("r2", "key") is False
    down = time.monotonic()
    server = RedisServer(port=port)
    try:
        assert patient.claim("r3", "") is False  # no key: stored under the bare id
        assert client.get(f"{NS}:gw:req:r3") is None  # within its wait: Redis not asked
        time.sleep(max(0.0, 0.3 - (time.monotonic() - down)))
        eager.claim("r4", "")
        assert client.get(f"{NS}:gw:req:r4") is not None  # asked again, and it answered
    finally:
        client.close()
        server.stop()


def test_a_replicas_own_stale_record_does_not_refuse_its_next_claim(redis_server, redis_client):
    one = SharedRequests(_client(redis_server), "one", NS)
    other = SharedRequests(_client(redis_server), "other", NS)
    one.claim("stale", "key")  # and its release never reached Redis
    one.claim("stale", "key")  # its own table says the id is free: the record is stale
    with pytest.raises(AlreadyExists):
        other.claim("stale", "key")
    one.release("stale", "key")
    assert other.claim("stale", "key") is False


def test_request_ids_are_scoped_per_key_across_replicas(redis_server, redis_client):
    one = SharedRequests(_client(redis_server), "one", NS)
    other = SharedRequests(_client(redis_server), "other", NS)
    assert one.claim("same", "key-alice") is False
    # another key's id on another replica: neither refused nor in the way
    assert other.claim("same", "key-mallory") is False
    with pytest.raises(AlreadyExists):
        other.claim("same", "key-alice")  # the same key still can't run it twice
    assert other.abort_elsewhere("same", "key-mallory") is False  # its own, not alice's
    assert redis_client.get(f"{NS}:gw:req:same") is None  # no key stored under the bare id
    one.release("same", "key-alice")
    other.release("same", "key-mallory")
    # no API keys: the one anonymous namespace, as before
    assert one.claim("bare", "") is False
    assert redis_client.get(f"{NS}:gw:req:bare") is not None
    with pytest.raises(AlreadyExists):
        other.claim("bare", "")
