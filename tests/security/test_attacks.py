"""A stranger on the same network against a real stack (processes, gRPC on loopback, Redis),
with API keys at the gateway and a cluster secret between the services: each attack of the
issue is refused, and the victims' output still equals the offline engine's. The client-facing
attacks; test_attacks_cluster.py has those on the workers, the KV path and Redis."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from splitserve.client import collect, connect, stream
from splitserve.protos.v1 import common_pb2
from tests.e2e.harness import assert_nothing_leaks
from tests.security.attack_setup import (
    ALICE,
    GREEDY,
    HOG,
    LONG,
    MALLORY,
    PROMPT,
    code_of,
)

pytestmark = pytest.mark.slow


def test_generate_needs_a_valid_key_and_health_stays_open(stack, oracle):
    for key in (None, "not-a-key"):
        channel, stub = connect(stack.address, key)
        with channel:
            code = code_of(lambda s=stub: collect(stream(s, PROMPT, GREEDY, timeout_s=30)))
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
            code = code_of(lambda: collect(stream(mallory, PROMPT, GREEDY, timeout_s=30)))
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
