"""A stranger on the same network against the same real stack as test_attacks.py: attacks on
the workers (calls without the cluster secret, reservations held), the KV path (pushes into a
victim's reservation) and Redis (forged or overwritten worker records); each is refused and the
victims' output still equals the offline engine's."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import torch

from splitserve.client import collect, connect, stream
from splitserve.engine import SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.model_config import ModelConfig
from splitserve.kv_transfer.cluster import caller_metadata
from splitserve.kv_transfer.grpc_transport import GrpcKVSender
from splitserve.kv_transfer.registry import Registry, WorkerInfo
from splitserve.kv_transfer.transport import Peer, Push, TransferError
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.runtime.auth import principal_of
from splitserve.runtime.secrets import redacted_url
from tests.e2e.harness import assert_nothing_leaks, member_metadata, workers
from tests.security.attack_setup import (
    ALICE,
    GREEDY,
    MALLORY,
    PER_CALLER,
    PROMPT,
    TOKENS_PER_MINUTE,
    code_of,
    worker_of,
)

pytestmark = pytest.mark.slow


def test_worker_calls_without_the_cluster_secret_are_refused(stack):
    decode, prefill = worker_of(stack, "decode"), worker_of(stack, "prefill")
    reserve = worker_pb2.ReserveRequest(
        request_id="stranger-1",
        prompt_token_ids=PROMPT,
        sampling=convert.sampling_to_proto(GREEDY),
    )
    with grpc.insecure_channel(decode.address) as d, grpc.insecure_channel(prefill.address) as p:
        dstub, pstub = worker_pb2_grpc.DecodeWorkerStub(d), worker_pb2_grpc.PrefillWorkerStub(p)
        wrong = (("x-splitserve-cluster-secret", "guessed"),)
        calls = [
            lambda md: dstub.Reserve(reserve, timeout=5, metadata=md),
            lambda md: list(
                dstub.Decode(worker_pb2.DecodeRequest(request_id="x"), timeout=5, metadata=md)
            ),
            lambda md: dstub.Abort(common_pb2.AbortRequest(request_id="x"), timeout=5, metadata=md),
            lambda md: dstub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=md),
            lambda md: pstub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=md),
            lambda md: pstub.Prefill(worker_pb2.PrefillRequest(), timeout=5, metadata=md),
        ]
        for call in calls:
            for metadata in (None, wrong):
                assert code_of(lambda c=call, m=metadata: c(m)) == grpc.StatusCode.UNAUTHENTICATED
        # a member's call goes through (the refusals above are about the secret alone)
        dstub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=member_metadata(stack))


def _push_into_a_planted_reservation(
    stack, model_dir, oracle, cluster_secret: str, capability: bytes | None
) -> TransferError:
    """The worst case: a real reservation (made by a member), its fence and blocks known; a
    rogue sender pushes random KV with a valid checksum into it (with `cluster_secret` and,
    unless None, `capability` instead of the one minted). Returns the push's refusal, after
    checking that a victim with the same prompt still gets the oracle's tokens."""
    decode = worker_of(stack, "decode")
    member = member_metadata(stack)
    registry = Registry(stack.redis_url)
    cfg = ModelConfig.from_pretrained(model_dir)
    pool = torch.randn(16, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    connector = KVConnector(KVCache.over(pool), BlockManager(16, 16), 16)
    rogue = GrpcKVSender(connector, cluster_secret=cluster_secret)
    try:
        peer = Peer(decode.worker_id, decode.address, registry.kv_endpoint(decode.worker_id) or {})
        with grpc.insecure_channel(decode.address) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            dest = stub.Reserve(
                worker_pb2.ReserveRequest(
                    request_id="planted",
                    prompt_token_ids=PROMPT,
                    sampling=convert.sampling_to_proto(GREEDY),
                ),
                timeout=10,
                metadata=member,
            ).destination
            assert len(dest.capability) == 16 and dest.capability != capability
            blocks = tuple(dest.block_ids)
            src = tuple(range(len(blocks)))
            cap = dest.capability if capability is None else capability
            push = Push("planted", dest.fence, src, blocks, len(PROMPT), capability=cap)
            with pytest.raises(TransferError) as err:
                rogue.push(peer, push, timeout_s=10)
            stub.Abort(common_pb2.AbortRequest(request_id="planted"), timeout=5, metadata=member)
    finally:
        rogue.close()
        registry.close()
    channel, gateway = connect(stack.address, ALICE)
    with channel:
        done = collect(stream(gateway, PROMPT, GREEDY, timeout_s=60))
    assert done.token_ids[0] == oracle[0]
    assert_nothing_leaks(stack)
    return err.value


def test_a_strangers_kv_push_is_refused_and_the_victim_gets_the_oracle(stack, model_dir, oracle):
    """Without the cluster secret even the reservation's own capability does not get in."""
    refused = _push_into_a_planted_reservation(stack, model_dir, oracle, "", None)
    assert refused.status == "UNAUTHENTICATED", refused


@pytest.mark.parametrize("capability", [b"", bytes(16)])
def test_a_members_push_without_the_reservations_capability_is_refused(
    stack, model_dir, oracle, capability
):
    """Even a member (it has the cluster secret) can't write into a reservation it was not
    handed: the push must carry the token minted with the reservation, not just its fence."""
    assert stack.secrets is not None
    secret = stack.secrets.cluster_secret
    refused = _push_into_a_planted_reservation(stack, model_dir, oracle, secret, capability)
    assert refused.status == "PERMISSION_DENIED" and "capability" in str(refused), refused


def test_redis_wants_its_password_so_no_fake_worker_registers(stack):
    bare = redacted_url(stack.redis_url).replace(":***@", "@").replace("//@", "//")
    client = redis.Redis.from_url(bare, socket_connect_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        client.ping()
    fake = WorkerInfo(
        worker_id="fake-decode", kind="decode", address="127.0.0.1:9", load=0,
        num_free_blocks=10_000, num_total_blocks=10_000, block_size=16,
    )  # fmt: skip
    stranger = Registry(bare)
    with pytest.raises(Exception) as err:  # noqa: B017 - redis-py's or the registry's error
        stranger.register_worker(fake, ttl_s=30)
    assert "authenticat" in str(err.value).lower(), err.value
    stranger.close()
    client.close()
    # the stack itself, with the password, sees only its own workers
    assert sorted(w.worker_id for w in workers(stack)) == ["decode-0", "prefill-0"]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_no_secret_in_any_process_argv(stack):
    assert stack.redis is not None and stack.secrets is not None
    keeper = stack.redis._proc.pid
    pids = [p.pid for p in stack.processes] + [keeper, *_children(keeper)]
    assert len(pids) == len(stack.processes) + 2  # the services, the keeper, redis-server
    hidden = [s for s in stack.secrets.hidden() if s]
    assert len(hidden) == 4  # two API keys, the cluster secret, Redis's password
    for pid in pids:
        cmdline = _cmdline(pid)
        assert not [s for s in hidden if s in cmdline], cmdline


def test_one_caller_holds_no_more_reservations_than_its_limit(stack, oracle):
    """The issue's pool exhaustion (256 reservations in 0.5 s) made by a member for one client:
    past `--max-reservations-per-caller` the decode worker refuses it, others still reserve,
    and the gateway names the client it acts for (its requests wait, then run)."""
    decode = worker_of(stack, "decode")
    member = member_metadata(stack)
    mallory = principal_of(MALLORY)

    def reserve(stub, request_id: str, caller: str):
        request = worker_pb2.ReserveRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT,
            sampling=convert.sampling_to_proto(GREEDY),
        )
        return stub.Reserve(request, timeout=10, metadata=(*member, *caller_metadata(caller)))

    with grpc.insecure_channel(decode.address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        held = [f"flood-{i}" for i in range(PER_CALLER)]
        for request_id in held:
            reserve(stub, request_id, mallory)
        refused = code_of(lambda: reserve(stub, "flood-more", mallory))
        assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
        reserve(stub, "someone-else", principal_of(ALICE))  # another client is not held up

        # Through the gateway, Mallory's request is counted against Mallory: it waits while
        # Mallory's reservations are all taken, and Alice's request runs meanwhile.
        results: dict[str, object] = {}

        def run(name: str, key: str) -> None:
            channel, gateway = connect(stack.address, key)
            with channel:
                results[name] = collect(stream(gateway, PROMPT, GREEDY, timeout_s=60))

        waiting = threading.Thread(target=run, args=("mallory", MALLORY))
        waiting.start()
        run("alice", ALICE)
        assert results["alice"].token_ids[0] == oracle[0]
        time.sleep(0.5)
        assert "mallory" not in results, "ran past its caller's reservation limit"
        for request_id in (*held, "someone-else"):
            stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=5, metadata=member)
        waiting.join(60)
        assert results["mallory"].token_ids[0] == oracle[0]
    assert_nothing_leaks(stack)


def test_a_forged_worker_record_gets_no_prompt_even_with_the_redis_password(stack, oracle):
    """Redis's password leaked (or Redis is shared): a stranger advertises a decode worker with
    a pool far emptier than the real one's. Its record has no valid seal (the cluster secret
    keys it), so the gateway never routes to it: its port sees no connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    fake = WorkerInfo(
        worker_id="a-decode", kind="decode", address=address, load=0,  # first by id, too
        num_free_blocks=1_000_000, num_total_blocks=1_000_000, block_size=16,
        kv_transports=("grpc",), max_num_seqs=256, max_model_len=4096,
    )  # fmt: skip
    stranger = Registry(stack.redis_url)  # the password, not the cluster secret
    try:
        stranger.register_worker(fake, ttl_s=60, kv_endpoint={"grpc.address": address.encode()})
        channel, gateway = connect(stack.address, ALICE)
        with channel:
            done = collect(stream(gateway, PROMPT, GREEDY, timeout_s=60))
            assert done.token_ids[0] == oracle[0]
            for i in range(4):  # NOTE: prompts no worker has cached: nothing favours the real one
                done = collect(stream(gateway, [200 + i] * 20, GREEDY, timeout_s=60))
                assert len(done.token_ids[0]) == GREEDY.max_tokens
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
    finally:
        stranger.deregister_worker("decode", "a-decode")
        stranger.close()
        listener.close()
    assert_nothing_leaks(stack)


def test_a_live_workers_record_overwritten_with_the_redis_password_is_repaired(stack, oracle):
    """Redis's password leaked, not the cluster secret: a stranger overwrites the live workers'
    records (fields changed, one added, the KV endpoint replaced). Each worker notices on its
    next heartbeat (every 0.25 s here) and rewrites its record; requests keep succeeding."""
    assert stack.secrets is not None
    member = Registry(stack.redis_url, secret=stack.secrets.cluster_secret)
    stranger = Registry(stack.redis_url)  # the password, not the cluster secret
    client = redis.Redis.from_url(stack.redis_url)
    channel, gateway = connect(stack.address, ALICE)
    try:
        real = {w.kind: w for kind in ("prefill", "decode") for w in member.live_workers(kind)}
        assert set(real) == {"prefill", "decode"}
        for info in real.values():
            key = f"{member.namespace}:worker:{info.kind}:{info.worker_id}"
            client.hset(key, mapping={"load": b"0", "address": b"127.0.0.1:1", "extra": b"x"})
            stranger._publish_endpoint(info.worker_id, {"grpc.address": b"127.0.0.1:1"}, 60_000)
        overwritten = time.monotonic()
        # NOTE: a worker may have repaired its record already; a forged one is never believed
        for kind in ("prefill", "decode"):
            assert all(w.address == real[kind].address for w in member.live_workers(kind))
        while not all(member.live_workers(kind) for kind in ("prefill", "decode")):
            assert time.monotonic() - overwritten < 1.0, "not repaired within a heartbeat"
            time.sleep(0.02)
        with channel:
            for _ in range(3):
                done = collect(stream(gateway, PROMPT, GREEDY, timeout_s=60))
                assert done.token_ids[0] == oracle[0]
        # the KV endpoints, repaired too: the stranger's one is gone from each
        forged = b"127.0.0.1:1"
        assert member.kv_endpoint(real["decode"].worker_id)["grpc.address"] != forged
        for info in real.values():
            raw = client.hgetall(f"{member.namespace}:kv_endpoint:{info.worker_id}")
            assert forged not in raw.values()
    finally:
        client.close()
        stranger.close()
        member.close()
    assert_nothing_leaks(stack)


def test_a_request_past_its_keys_token_rate_is_refused_on_both_apis(stack, model_dir, oracle):
    """16 samples of 1,500 tokens ask for more than the key's tokens per minute: refused before
    any worker sees it (gRPC RESOURCE_EXHAUSTED, HTTP 429), and the key still has its budget."""
    huge = SamplingParams(temperature=0, max_tokens=1500, n=16, ignore_eos=True)
    channel, gateway = connect(stack.address, ALICE)
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            collect(stream(gateway, PROMPT, huge, timeout_s=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{TOKENS_PER_MINUTE} per minute" in err.value.details()
        body = {"model": model_dir.name, "prompt": PROMPT, "max_tokens": 1500, "n": 16}
        reply = httpx.post(
            stack.http_url + "/completions", json=body, timeout=30,
            headers={"Authorization": f"Bearer {ALICE}"},
        )  # fmt: skip
        assert reply.status_code == 429, reply.text
        assert "per minute" in reply.json()["error"]["message"]
        done = collect(stream(gateway, PROMPT, GREEDY, timeout_s=60))
        assert done.token_ids[0] == oracle[0]
    assert_nothing_leaks(stack)
