"""Workers that die or freeze under load: no stream that could finish is lost.

A decode worker SIGKILLed with streams in flight: each stream moves to the other decode worker
and goes on with the tokens the dead one would have produced (greedy and seeded sampling, with
penalties that count the generated tokens). A prefill worker killed mid-transfer: its requests
are prefilled again elsewhere. (A frozen worker, SIGSTOPped: tests/chaos/test_freeze.py.) Each
test ends with the leak check, prefix index included. Tokens are checked against the offline
engine.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import Completion, collect, stream
from splitserve.engine import LLM, SamplingParams
from splitserve.launch.up import Stack
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

# A silent stream is checked after 2 s; the harness's heartbeats lapse after 1.5 s.
GATEWAY_ARGS = ("--stall-timeout-s", "2", "--rpc-timeout-s", "2", "--suspect-s", "60")
MAX_TOKENS = 128


def _params(i: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Even requests greedy, odd ones seeded with temperature; both with output penalties."""
    if i % 2:
        return SamplingParams(
            temperature=0.9, top_k=50, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True,
            presence_penalty=0.5, min_tokens=4,
        )  # fmt: skip
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, frequency_penalty=0.4
    )


class Streams:
    """Requests streamed through the gateway on threads."""

    def __init__(self, stack: Stack, pool: ThreadPoolExecutor) -> None:
        self.stub = gateway(stack)
        self.pool = pool

    def start(self, request_id: str, prompt: list[int], params: SamplingParams) -> Future:
        return self.pool.submit(
            lambda: collect(stream(self.stub, prompt, params, request_id, timeout_s=120))
        )


def _offline(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _migrations(stack: Stack) -> float:
    port = stack.metrics_ports["gateway"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "splitserve:stream_migrations_total"
    )


def _wait_busy(stack: Stack, worker_id: str, num_running: int, timeout_s: float = 60) -> None:
    """Until the worker decodes `num_running` streams. NOTE: asked of the worker itself: a
    client reads its stream later than the worker writes it."""
    worker = next(w for w in workers(stack) if w.worker_id == worker_id)
    deadline = time.monotonic() + timeout_s
    most = 0
    while (running := stats(worker, stack).num_running) < num_running:
        most = max(most, running)
        if time.monotonic() >= deadline:
            # NOTE: where the streams were instead, to tell a routing fault from a slow host
            seen = {w.worker_id: (stats(w, stack).num_running, stats(w, stack).num_waiting)
                    for w in workers(stack)}  # fmt: skip
            raise AssertionError(
                f"{worker_id} never ran {num_running} streams in {timeout_s} s (at most {most});"
                f" (running, waiting) now: {seen}"
            )
        time.sleep(0.005)


def _wait_gone(stack: Stack, worker_id: str, timeout_s: float = 10) -> None:
    """Until a killed worker's heartbeat has lapsed (the leak check asks every live worker)."""
    deadline = time.monotonic() + timeout_s
    while any(w.worker_id == worker_id for w in workers(stack)):
        assert time.monotonic() < deadline, f"{worker_id} is still in the registry"
        time.sleep(0.1)


def _check(done: Completion, prompt: list[int], params: SamplingParams, expected: list[int]):
    assert done.token_ids[0] == expected, done.request_id
    assert done.finished is not None, done.request_id
    assert done.finished.usage.prompt_tokens == len(prompt)
    assert done.finished.usage.completion_tokens == params.max_tokens


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"])


def test_decode_worker_killed_with_24_streams_in_flight_loses_none(tiny_models, llm):
    prompts = random_prompts([20 + 3 * i for i in range(24)], 500, seed=71)
    params = [_params(i) for i in range(24)]
    expected = _offline(llm, prompts, params)
    with (
        running_stack(
            tiny_models["llama"], prefill=2, decode=2, metrics=True,
            extra_gateway_args=GATEWAY_ARGS,
        ) as stack,
        ThreadPoolExecutor(24) as pool,
    ):  # fmt: skip
        streams = Streams(stack, pool)
        futures = [streams.start(f"kill-{i}", p, params[i]) for i, p in enumerate(prompts)]
        # Streams are under way on decode-0 (the others are being prefilled): it dies.
        _wait_busy(stack, "decode-0", 4)
        os.kill(stack.process("decode-0").pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
        for i, done in enumerate(results):
            _check(done, prompts[i], params[i], expected[i])
        assert _migrations(stack) >= 1
        _wait_gone(stack, "decode-0")
        assert_nothing_leaks(stack)


def _engine_core_pid(pid: int) -> int:
    """The engine core process a worker process started (its spawned child)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return child
    raise AssertionError(f"process {pid} has no engine core among {children}")


def test_decode_engine_core_killed_with_streams_in_flight_is_a_dead_worker(tiny_models, llm):
    """SIGKILL of a decode worker's engine core process, not of the worker: the worker exits
    as a whole, and its streams move and finish as they do when the worker is killed."""
    prompts = random_prompts([20 + 3 * i for i in range(12)], 500, seed=75)
    params = [_params(i) for i in range(12)]
    expected = _offline(llm, prompts, params)
    with (
        running_stack(
            tiny_models["llama"], prefill=1, decode=2, metrics=True,
            extra_gateway_args=GATEWAY_ARGS,
        ) as stack,
        ThreadPoolExecutor(12) as pool,
    ):  # fmt: skip
        streams = Streams(stack, pool)
        futures = [streams.start(f"core-{i}", p, params[i]) for i, p in enumerate(prompts)]
        _wait_busy(stack, "decode-0", 3)
        front = stack.process("decode-0")
        os.kill(_engine_core_pid(front.pid), signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
        for i, done in enumerate(results):
            _check(done, prompts[i], params[i], expected[i])
        assert front.wait(timeout=30) != 0  # the worker died with its core
        assert _migrations(stack) >= 1
        _wait_gone(stack, "decode-0")
        assert_nothing_leaks(stack)


def test_prefill_worker_killed_mid_transfer_every_request_completes(tiny_models, llm):
    prompts = random_prompts([700 + 40 * i for i in range(8)], 500, seed=72)
    params = [_params(i, max_tokens=8) for i in range(8)]
    expected = _offline(llm, prompts, params)
    with (
        running_stack(tiny_models["llama"], prefill=2, decode=2) as stack,
        ThreadPoolExecutor(8) as pool,
    ):
        streams = Streams(stack, pool)
        futures = [streams.start(f"pkill-{i}", p, params[i]) for i, p in enumerate(prompts)]
        victim = next(w for w in workers(stack) if w.worker_id == "prefill-0")
        deadline = time.monotonic() + 30
        while stats(victim, stack).kv_bytes_sent == 0:
            assert time.monotonic() < deadline, "prefill-0 never pushed any KV"
            time.sleep(0.01)
        os.kill(stack.process("prefill-0").pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
        for i, done in enumerate(results):
            _check(done, prompts[i], params[i], expected[i])
        _wait_gone(stack, "prefill-0")
        assert_nothing_leaks(stack)


def test_a_push_to_a_dead_decode_worker_fails_aborted_not_unavailable(tiny_models, llm):
    """The prefill worker blames the destination, not itself: a push to a decode worker that
    died after its Reserve fails ABORTED (retry with a fresh reservation), never UNAVAILABLE,
    which the gateway takes to mean the prefill worker is gone. With one prefill worker, that
    mistake failed a request ("no prefill worker is alive") that the other decode worker could
    serve."""
    import grpc

    from splitserve.protos import convert
    from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
    from tests.e2e.harness import member_metadata

    prompt = random_prompts([40], 500, seed=76)[0]
    greedy = _params(0, max_tokens=8)
    with running_stack(
        tiny_models["llama"], prefill=1, decode=2, extra_gateway_args=GATEWAY_ARGS
    ) as stack:
        live = {w.worker_id: w for w in workers(stack)}
        member = member_metadata(stack)
        sampling = convert.sampling_to_proto(greedy)
        with grpc.insecure_channel(live["decode-0"].address) as channel:
            reserve = worker_pb2.ReserveRequest(
                request_id="orphan", prompt_token_ids=prompt, sampling=sampling
            )
            dest = worker_pb2_grpc.DecodeWorkerStub(channel).Reserve(
                reserve, timeout=10, metadata=member
            ).destination
        victim = stack.process("decode-0")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        stack.processes.remove(victim)
        with (
            grpc.insecure_channel(live["prefill-0"].address) as channel,
            pytest.raises(grpc.RpcError) as failed,
        ):
            worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                worker_pb2.PrefillRequest(
                    request_id="orphan", prompt_token_ids=prompt, sampling=sampling,
                    destination=dest,
                ),
                timeout=60,
                metadata=member,
            )  # fmt: skip
        assert failed.value.code() == grpc.StatusCode.ABORTED, failed.value
        assert "decode-0" in failed.value.details()
        _wait_gone(stack, "decode-0")
        done = collect(stream(gateway(stack), prompt, greedy, "after", timeout_s=60))
        _check(done, prompt, greedy, _offline(llm, [prompt], [greedy])[0])
        assert_nothing_leaks(stack)
