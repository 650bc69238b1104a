"""A stranger against the NIXL plane: a decode worker's receiver (its own process, real NIXL over
UCX on the CPU) publishes its endpoint in a real Redis and vets senders through the registry,
as `splitserve decode` does; the last test runs the whole stack. Whoever reads Redis without
the cluster secret learns nothing that loads as NIXL metadata; an agent no member vouches for
is not heard at all, even one that holds the metadata: its notifications touch no request, and
a member's push still lands."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import redis
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.model_config import ModelConfig
from splitserve.kv_transfer.nixl_transport import SENDER_FIELD, NixlSender
from splitserve.kv_transfer.redis_server import RedisServer
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.transport import Peer, Push
from splitserve.protos import convert
from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.harness import assert_nothing_leaks, member_metadata, running_stack, workers
from tests.e2e.nixl_peer import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    TIMEOUT_S,
    RemoteReceiver,
    as_bytes,
    make_connector,
    make_pool,
)

pytestmark = pytest.mark.slow

SECRET = "cluster-secret-of-the-nixl-test"
ENDPOINT_KEY = "splitserve:kv_endpoint:decode-0"


@pytest.fixture
def decode(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[RemoteReceiver]:
    """A decode worker's NIXL receiver, registered (sealed, concealed) under the secret."""
    remote = RemoteReceiver("float32", redis_server.url, SECRET)
    yield remote
    remote.close()


@pytest.fixture
def member(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Registry]:
    reg = Registry(redis_server.url, secret=SECRET)
    yield reg
    reg.close()


def _peer(member: Registry) -> Peer:
    """The decode worker as a member reaches it (the test knows the secret: so does a
    stranger below that got hold of the metadata anyway)."""
    endpoint = member.kv_endpoint("decode-0")
    assert endpoint is not None
    return Peer("decode-0", "unused:0", endpoint)


def _register_prefill(member: Registry, sender: NixlSender) -> None:
    info = WorkerInfo("prefill-0", "prefill", "unused:0", block_size=BLOCK_SIZE,
                      kv_transports=("nixl",))  # fmt: skip
    member.register_worker(info, ttl_s=60, kv_endpoint=sender.endpoint())


def _wait_stats(remote: RemoteReceiver, before: dict[str, int], **expected: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        delta = remote.stats_since(before)
        if all(delta[k] == v for k, v in expected.items()):
            return
        assert time.monotonic() < deadline, delta
        time.sleep(0.01)


@pytest.fixture
def reader(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """A client of Redis with its password (here: none) but not the cluster secret."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_with_only_redis_read_access_a_stranger_gets_no_nixl_metadata(
    decode: RemoteReceiver, member: Registry, reader: redis.Redis, redis_server: RedisServer
) -> None:
    metadata = _peer(member).endpoint["nixl.metadata"]
    assert metadata.startswith(b"nixlSerDes")  # a member reads the real thing
    raw = reader.hgetall(ENDPOINT_KEY)
    assert b"nixl.metadata" not in raw and b"concealed:nixl.metadata" in raw
    assert not any(b"nixlSerDes" in value or metadata in value for value in raw.values())
    # Every stored value, fed to NIXL as an agent's metadata, is refused.
    stranger = NixlSender(make_connector(make_pool(torch.float32)), "stranger")
    try:
        for value in raw.values():
            with pytest.raises(Exception, match="NIXL_ERR"):
                stranger._nixl.agent.add_remote_agent(value)
    finally:
        stranger.close()
    # The registry without the secret (or with a guess) opens no record either.
    for secret in ("", "a-guess"):
        outsider = Registry(redis_server.url, secret=secret)
        try:
            assert outsider.kv_endpoint("decode-0") is None
        finally:
            outsider.close()


def test_a_senders_agent_name_is_published_concealed(member: Registry, reader: redis.Redis) -> None:
    sender = NixlSender(make_connector(make_pool(torch.float32)), "prefill-0")
    try:
        _register_prefill(member, sender)
        name = sender._nixl.name.encode()
        assert len(name) == len("prefill-0-") + 32  # 128 random bits: not to be guessed
        raw = reader.hgetall("splitserve:kv_endpoint:prefill-0")
        assert raw and not any(name in value for value in raw.values())
        assert member.kv_endpoint_values(SENDER_FIELD) == {name}
    finally:
        sender.close()


def test_an_unvouched_agents_notifications_are_dropped_and_touch_no_request(
    decode: RemoteReceiver, member: Registry
) -> None:
    """The stranger holds the metadata, the victim's fence and (here, empty) capability:
    without the vetting its write would land, and its second push fail the request."""
    peer = _peer(member)
    before = decode.call("stats")
    decode.call("reserve", "victim", 7, [10, 11])
    # It even names itself like the member's prefill worker (its random part is a guess).
    stranger = NixlSender(make_connector(make_pool(torch.float32, seed=66)), "prefill-0")
    legit_pool = make_pool(torch.float32, seed=5)
    legit = NixlSender(make_connector(legit_pool), "prefill-0")
    try:
        stranger.push(peer, Push("victim", 7, (0, 1), (10, 11), 32), TIMEOUT_S)
        wrong = Push("victim", 7, (2,), (10,), 16, capability=b"wrong")
        stranger.push(peer, wrong, TIMEOUT_S)
        _wait_stats(decode, before, num_unvouched=2)
        assert decode.call("events") == []  # nothing landed, nothing refused

        # A member's sender registered after the stranger's notifications made the receiver
        # read the registry: its first push is still taken.
        _register_prefill(member, legit)
        legit.push(peer, Push("victim", 7, (3, 4), (10, 11), 32), TIMEOUT_S)
        events = decode.wait_events(1, landed=1)
        assert events == [("landed", "victim", 7, [10, 11], 2 * BLOCK_BYTES)]
        assert torch.equal(as_bytes(decode.pool()[[10, 11]]), as_bytes(legit_pool[[3, 4]]))
        _wait_stats(decode, before, num_unvouched=2, num_pushes=1, num_refused=0)
    finally:
        stranger.close()
        legit.close()


def test_a_flood_of_unvouched_notifications_reads_redis_at_most_twice_a_second(
    decode: RemoteReceiver, member: Registry, redis_client: redis.Redis
) -> None:
    def reads() -> int:
        stats = redis_client.info("commandstats")
        return int(stats.get("cmdstat_smembers", {}).get("calls", 0))

    peer = _peer(member)
    stranger = NixlSender(make_connector(make_pool(torch.float32)), "stranger")
    before, reads_before, started = decode.call("stats"), reads(), time.monotonic()
    try:
        for i in range(300):
            stranger.push(peer, Push(f"nobody-{i}", 1, (0,), (63,), 16), TIMEOUT_S)
        _wait_stats(decode, before, num_unvouched=300)
    finally:
        stranger.close()
    elapsed = time.monotonic() - started
    # A look-up reads the worker sets of the three kinds and the KV peers' set; at most one
    # look-up per 0.5 s.
    assert (reads() - reads_before) / 4 <= elapsed / 0.5 + 1
    assert decode.call("events") == []


PROMPT = list(range(10, 74))  # 4 full blocks
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def stack(model_dir):
    with running_stack(
        model_dir, prefill=1, decode=1, kv_transport="nixl", cluster_secret=True
    ) as s:
        assert s.secrets is not None and s.secrets.cluster_secret
        yield s


def test_in_a_stack_a_strangers_nixl_write_is_not_heard_and_the_victim_gets_the_oracle(
    stack, model_dir
):
    """The stranger got the decode worker's metadata (the test holds the secret) and the
    planted reservation's fence and blocks: had its notifications been read, the one with a
    wrong capability would fail the request. (Its bytes do land: a one-sided write can't be
    stopped by the receiver, which is why the metadata is concealed; the member's push
    overwrites them here.)"""
    expected = LLM(model_dir).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert stack.secrets is not None
    decode = next(w for w in workers(stack) if w.kind == "decode")
    prefill = next(w for w in workers(stack) if w.kind == "prefill")
    raw = redis.Redis.from_url(stack.redis_url)  # with Redis's password
    registry = Registry(stack.redis_url, secret=stack.secrets.cluster_secret)
    try:
        stored = raw.hgetall(f"splitserve:kv_endpoint:{decode.worker_id}")
        assert b"concealed:nixl.metadata" in stored and b"nixl.metadata" not in stored
        sender = raw.hgetall(f"splitserve:kv_endpoint:{prefill.worker_id}")
        assert b"concealed:nixl.sender" in sender
        endpoint = registry.kv_endpoint(decode.worker_id)
        assert endpoint is not None
    finally:
        raw.close()
        registry.close()
    cfg = ModelConfig.from_pretrained(model_dir)
    pool = torch.randn(16, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    stranger = NixlSender(make_connector(pool), prefill.worker_id)
    member = member_metadata(stack)
    sampling = convert.sampling_to_proto(GREEDY)
    try:
        with (
            grpc.insecure_channel(decode.address) as d,
            grpc.insecure_channel(prefill.address) as p,
        ):
            dstub, pstub = worker_pb2_grpc.DecodeWorkerStub(d), worker_pb2_grpc.PrefillWorkerStub(p)
            request = worker_pb2.ReserveRequest(
                request_id="planted", prompt_token_ids=PROMPT, sampling=sampling
            )
            dest = dstub.Reserve(request, timeout=10, metadata=member).destination
            blocks = tuple(dest.block_ids)
            peer = Peer(decode.worker_id, decode.address, endpoint)
            src, num_tokens = tuple(range(len(blocks))), len(PROMPT)
            for capability in (dest.capability, b"guessed"):
                attack = Push("planted", dest.fence, src, blocks, num_tokens, capability=capability)
                stranger.push(peer, attack, 10)
            time.sleep(1.0)  # its notifications are in (and dropped) long before the member's
            prefilled = pstub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="planted", prompt_token_ids=PROMPT, sampling=sampling,
                    destination=dest,
                ),
                timeout=60,
                metadata=member,
            )  # fmt: skip
            assert [t.token_id for t in prefilled.first_tokens] == expected[:1]
            tokens: list[int] = []  # the first token included
            decoded = worker_pb2.DecodeRequest(
                request_id="planted", sampling=sampling, first_tokens=prefilled.first_tokens
            )
            for message in dstub.Decode(decoded, timeout=60, metadata=member):
                if message.HasField("chunk"):
                    tokens += list(message.chunk.token_ids)
    finally:
        stranger.close()
    assert tokens == expected
    assert_nothing_leaks(stack)
