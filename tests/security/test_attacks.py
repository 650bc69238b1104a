"""A stranger on the same network against a real stack (processes, gRPC on loopback, Redis),
with API keys at the gateway and a cluster secret between the services: each attack of the
issue is refused, and the victims' output still equals the offline engine's."""

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
from splitserve.engine import LLM, SamplingParams
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
from tests.e2e.harness import assert_nothing_leaks, member_metadata, running_stack, workers

pytestmark = pytest.mark.slow

ALICE, MALLORY = "alice-key-0123456789", "mallory-key-9876543210"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(10, 74))  # 64 tokens: 4 full blocks, the prefix of the attack
LONG = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
# NOTE: held until cancelled: on a busy host one 160-token hog could end before the other's
# first token came
HOG = SamplingParams(temperature=0, max_tokens=1800, ignore_eos=True)
PER_CALLER = 4  # --max-reservations-per-caller of the decode worker
TOKENS_PER_MINUTE = 20_000  # --max-tokens-per-minute-per-key: ample for every other test here


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def oracle(model_dir):
    llm = LLM(model_dir)
    outs = llm.generate([PROMPT, PROMPT], [GREEDY, LONG], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def stack(model_dir):
    with running_stack(
        model_dir, prefill=1, decode=1, kv_transport="grpc", api_keys=(ALICE, MALLORY),
        extra_gateway_args=("--max-inflight-per-key", "2",
                            "--max-tokens-per-minute-per-key", str(TOKENS_PER_MINUTE)),
        http_port=0,
        worker_args=("--max-reservations-per-caller", str(PER_CALLER)),
    ) as s:  # fmt: skip
        assert s.secrets is not None and s.secrets.cluster_secret  # on: API keys are given
        yield s


def _worker(stack, kind: str) -> WorkerInfo:
    return next(w for w in workers(stack) if w.kind == kind)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_generate_needs_a_valid_key_and_health_stays_open(stack, oracle):
    for key in (None, "not-a-key"):
        channel, stub = connect(stack.address, key)
        with channel:
            code = _code(lambda s=stub: collect(stream(s, PROMPT, GREEDY, timeout_s=30)))
            assert code == grpc.StatusCode.UNAUTHENTICATED
    channel, stub = connect(stack.address, ALICE)
    with channel:
        done = collect(stream(stub, PROMPT, GREEDY, timeout_s=60))
    assert done.token_ids[0] == oracle[0]


def test_the_http_api_checks_the_same_keys(stack, model_dir):
    body = {"model": model_dir.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    url = stack.http_url + "/completions"
    for headers in ({}, {"Authorization": "Bearer not-a-key"}):
        assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 401
    reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    root = stack.http_url.removesuffix("/v1")
    assert httpx.get(root + "/health").status_code == 200
    assert httpx.get(root + "/version").status_code == 200  # open, like /health
    alice = {"Authorization": f"Bearer {ALICE}"}
    for method, path, payload in (
        ("POST", "/tokenize", {"prompt": "hello"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
        ("GET", "/metrics", None),
    ):
        assert httpx.request(method, root + path, json=payload).status_code == 401, path
        assert httpx.request(method, root + path, json=payload, headers=alice).status_code == 200


def test_a_strangers_abort_does_not_touch_the_victims_request(stack, oracle):
    alice_channel, alice = connect(stack.address, ALICE)
    mallory_channel, mallory = connect(stack.address, MALLORY)
    result: dict = {}

    def victim() -> None:
        result["done"] = collect(stream(alice, PROMPT, LONG, request_id="victim-1", timeout_s=120))

    with alice_channel, mallory_channel:
        # an abort sent before the victim's request arrives must not wait for it either
        assert not mallory.Abort(common_pb2.AbortRequest(request_id="victim-1"), timeout=5).aborted
        thread = threading.Thread(target=victim)
        thread.start()
        answers = []
        while thread.is_alive():
            reply = mallory.Abort(common_pb2.AbortRequest(request_id="victim-1"), timeout=5)
            answers.append(reply.aborted)
            time.sleep(0.01)
        thread.join()
        assert answers and not any(answers)
        done = result["done"]
        assert done.finished.samples[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert done.token_ids[0] == oracle[1]

        # the owner's abort still works: the test can tell an abort that lands
        thread = threading.Thread(target=victim)
        thread.start()
        aborted = False
        while thread.is_alive() and not aborted:
            reply = alice.Abort(common_pb2.AbortRequest(request_id="victim-1"), timeout=5)
            aborted = reply.aborted
            time.sleep(0.005)
        thread.join()
        assert aborted
        assert result["done"].finished.samples[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert_nothing_leaks(stack)


def test_one_key_cannot_take_every_slot(stack, oracle):
    mallory_channel, mallory = connect(stack.address, MALLORY)
    alice_channel, alice = connect(stack.address, ALICE)
    started = threading.Barrier(3)
    release = threading.Event()

    def hog(i: int) -> None:
        responses = stream(mallory, PROMPT, HOG, request_id=f"hog-{i}", timeout_s=120)
        next(responses)  # in flight: its first tokens are out
        started.wait(60)
        release.wait(60)
        responses.cancel()

    with mallory_channel, alice_channel:
        hogs = [threading.Thread(target=hog, args=(i,)) for i in range(2)]
        for thread in hogs:
            thread.start()
        try:
            started.wait(60)
            code = _code(lambda: collect(stream(mallory, PROMPT, GREEDY, timeout_s=30)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            done = collect(stream(alice, PROMPT, GREEDY, timeout_s=60))  # others still served
            assert done.token_ids[0] == oracle[0]
        finally:
            release.set()
            for thread in hogs:
                thread.join()
        # its slots come back once the gateway has seen the cancels
        deadline = time.monotonic() + 15
        while True:
            try:
                done = collect(stream(mallory, PROMPT, GREEDY, timeout_s=60))
                break
            except grpc.RpcError as err:
                busy = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
                if not busy or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert done.token_ids[0] == oracle[0]
    assert_nothing_leaks(stack)


def _running(stub, request_id: str, started: threading.Event, result: dict) -> None:
    """Stream a LONG request, noting its first message and its end in `result`."""
    responses = stream(stub, PROMPT, LONG, request_id=request_id, timeout_s=120)
    first = next(responses)
    started.set()
    result["done"] = collect(iter([first, *responses]))


def test_another_keys_duplicate_id_neither_learns_nor_blocks(stack, oracle):
    alice_channel, alice = connect(stack.address, ALICE)
    mallory_channel, mallory = connect(stack.address, MALLORY)
    with alice_channel, mallory_channel:
        for first_key, first, second in ((ALICE, alice, mallory), (MALLORY, mallory, alice)):
            rid, started, result = f"dup-{first_key[:5]}", threading.Event(), {}
            thread = threading.Thread(target=_running, args=(first, rid, started, result))
            thread.start()
            assert started.wait(60)
            # the same key still can't run one id twice ...
            with pytest.raises(grpc.RpcError) as err:
                collect(stream(first, PROMPT, GREEDY, request_id=rid, timeout_s=30))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            # ... but another key's request with it runs, unrefused and with the right tokens
            assert "done" not in result  # the first one still runs
            done = collect(stream(second, PROMPT, GREEDY, request_id=rid, timeout_s=60))
            assert done.request_id == rid and done.token_ids[0] == oracle[0]
            assert not second.Abort(common_pb2.AbortRequest(request_id=rid), timeout=5).aborted
            thread.join()
            done = result["done"]
            assert done.request_id == rid and done.token_ids[0] == oracle[1]
            assert done.finished.samples[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_nothing_leaks(stack)


def test_worker_calls_without_the_cluster_secret_are_refused(stack):
    decode, prefill = _worker(stack, "decode"), _worker(stack, "prefill")
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
                assert _code(lambda c=call, m=metadata: c(m)) == grpc.StatusCode.UNAUTHENTICATED
        # a member's call goes through (the refusals above are about the secret alone)
        dstub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=member_metadata(stack))


def _push_into_a_planted_reservation(
    stack, model_dir, oracle, cluster_secret: str, capability: bytes | None
) -> TransferError:
    """The worst case: a real reservation (made by a member), its fence and blocks known; a
    rogue sender pushes random KV with a valid checksum into it (with `cluster_secret` and,
    unless None, `capability` instead of the one minted). Returns the push's refusal, after
    checking that a victim with the same prompt still gets the oracle's tokens."""
    decode = _worker(stack, "decode")
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
    decode = _worker(stack, "decode")
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
        refused = _code(lambda: reserve(stub, "flood-more", mallory))
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
