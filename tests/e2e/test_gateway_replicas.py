"""Several gateway processes in front of the same workers: `splitserve gateway --processes 2` on
one port (gRPC and HTTP), and a second gateway on a port of its own, all sharing one Redis.
Tokens equal the offline engine's through any of them; an Abort sent to one gateway stops the
request another one runs; a request id running on one is refused by another; prefill budgets
hold across replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from splitserve.launch.up import Stack, free_port
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, gateway_pb2
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
ABORT = common_pb2.FINISH_REASON_ABORT


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def stack(model_dir) -> Iterator[Stack]:
    """1 prefill + 1 decode worker behind `up --gateways 2`: two gateway processes on one port
    (gRPC and HTTP)."""
    with running_stack(model_dir, prefill=1, decode=1, http_port=0, gateways=2) as s:
        yield s


@pytest.fixture(scope="module")
def other(stack, model_dir) -> Iterator[str]:
    """A second gateway, on a port of its own, over the same Redis and workers."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "gateway", "--model", str(model_dir),
         "--port", str(port), "--processes", "1"],
        env={**os.environ, "SPLITSERVE_REDIS_URL": stack.redis_url},
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "serving on" in line, line
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def _stub(address: str):
    return gateway(Stack(address, "", ""))


def _first_tokens(call, n: int) -> None:
    got = 0
    for msg in call:
        got += len(msg.chunk.token_ids)
        if got >= n:
            return
    raise AssertionError("the stream ended early")


def test_the_gateway_runs_two_processes_on_one_port(stack):
    parent = stack.process("gateway")
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
    assert len(children) == 2


def test_tokens_over_grpc_and_http_equal_offline_through_two_processes(stack, model_dir):
    llm = LLM(model_dir)
    prompts = random_prompts([3, 17, 40, 64, 90, 12, 33, 5], llm.engine.model_config.vocab_size, 7)
    want = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    def over_grpc(prompt):  # NOTE: a channel each, so that connections spread over processes
        with grpc.insecure_channel(stack.address) as channel:
            from splitserve.protos.v1 import gateway_pb2_grpc

            return collect(
                stream(gateway_pb2_grpc.GatewayStub(channel), prompt, GREEDY, timeout_s=120)
            )

    def over_http(prompt):
        body = {"model": model_dir.name, "prompt": prompt, "max_tokens": GREEDY.max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        reply = httpx.post(f"{stack.http_url}/completions", json=body, timeout=120)
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        grpc_out = list(pool.map(over_grpc, prompts))
        http_out = list(pool.map(over_http, prompts))
    assert [r.token_ids[0] for r in grpc_out] == [w.token_ids for w in want]
    assert http_out == [w.text for w in want]
    assert_nothing_leaks(stack)


def test_abort_sent_to_another_gateway_stops_the_request(stack, other):
    call = stream(gateway(stack), [9] * 20, LONG, request_id="cross-abort", timeout_s=120)
    _first_tokens(call, 3)
    started = time.monotonic()
    reply = _stub(other).Abort(common_pb2.AbortRequest(request_id="cross-abort"), timeout=10)
    assert reply.aborted
    done = collect(call)
    assert done.finished.samples[0].finish_reason == ABORT
    assert done.finished.usage.completion_tokens < LONG.max_tokens
    assert time.monotonic() - started < 5.0
    assert_nothing_leaks(stack)


def test_an_abort_before_the_request_arrives_elsewhere_ends_it_at_once(stack, other):
    reply = _stub(other).Abort(common_pb2.AbortRequest(request_id="early-abort"), timeout=10)
    assert not reply.aborted  # nothing ran yet
    done = collect(stream(gateway(stack), [9] * 20, LONG, request_id="early-abort", timeout_s=60))
    assert done.finished.samples[0].finish_reason == ABORT
    assert_nothing_leaks(stack)


def test_a_running_request_id_is_refused_by_another_gateway(stack, other):
    call = stream(gateway(stack), [9] * 20, LONG, request_id="dup-id", timeout_s=120)
    _first_tokens(call, 1)
    with pytest.raises(grpc.RpcError) as err:
        collect(stream(_stub(other), [5] * 8, GREEDY, request_id="dup-id", timeout_s=30))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    assert_nothing_leaks(stack)
    # Once it ended, the id is free again, on any gateway.
    done = collect(stream(_stub(other), [5] * 8, GREEDY, request_id="dup-id", timeout_s=60))
    assert done.finished.usage.completion_tokens == GREEDY.max_tokens


def test_stream_interval_sends_at_least_four_tokens_a_chunk_over_grpc_and_http(stack, model_dir):
    llm = LLM(model_dir)
    want = llm.generate([[7] * 12], GREEDY, use_tqdm=False)[0].outputs[0]
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[7] * 12),
        sampling=convert.sampling_to_proto(GREEDY),
        stream_interval=4,
    )
    chunks = []
    for msg in gateway(stack).Generate(request, timeout=60):
        if msg.HasField("chunk"):
            chunks.append(list(msg.chunk.token_ids))
    assert [t for c in chunks for t in c] == want.token_ids
    # At least four a message but the last: what queued up meanwhile goes out with them.
    assert all(len(c) >= 4 for c in chunks[:-1]) and chunks[-1], chunks

    body = {"model": model_dir.name, "prompt": [7] * 12, "max_tokens": GREEDY.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_interval": 4}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{stack.http_url}/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(texts) == want.text
    assert len(texts) <= GREEDY.max_tokens // 4 + 1  # one event per 4 tokens (+ the last one)


def test_stream_interval_ms_spaces_the_chunks_over_grpc_and_http(stack, model_dir):
    """A request's stream_interval_ms: the same tokens, fewer messages, each chunk after the
    first at least that long after the one before (a lower bound: never sent sooner)."""
    # NOTE: long enough to span several gaps on any host (a CPU step takes a few ms)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    want = LLM(model_dir).generate([[9] * 12], params, use_tqdm=False)[0].outputs[0]
    gap_s = 0.1
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[9] * 12),
        sampling=convert.sampling_to_proto(params),
        stream_interval_ms=round(gap_s * 1000),
    )
    chunks, arrivals = [], []
    for msg in gateway(stack).Generate(request, timeout=60):
        if msg.HasField("chunk"):
            chunks.append(list(msg.chunk.token_ids))
            arrivals.append(time.monotonic())
    assert [t for c in chunks for t in c] == want.token_ids
    # NOTE: not the last chunk: it is flushed at the stream's end, not at the gap; arrivals
    # may bunch a little on a busy host, hence the margin
    gaps = [b - a for a, b in zip(arrivals[:-2], arrivals[1:-1], strict=True)]
    assert gaps and all(g >= gap_s * 0.5 for g in gaps), gaps
    assert len(chunks) < len(want.token_ids) / 2, chunks

    body = {"model": model_dir.name, "prompt": [9] * 12, "max_tokens": params.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_interval_ms": 100}  # fmt: skip
    texts = []
    with httpx.stream("POST", f"{stack.http_url}/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                if event["choices"]:
                    texts.append(event["choices"][0]["text"])
    assert "".join(texts) == want.text
    body["stream_interval_ms"] = -1
    reply = httpx.post(f"{stack.http_url}/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "stream_interval_ms" in reply.text, reply.text
