"""Health follows each service's life (NOT_SERVING while loading, SERVING, NOT_SERVING while
draining), and a SIGTERM drains: nothing new is admitted, what is in flight finishes with all its
tokens, and the process exits 0."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.kv_transfer.registry import Registry
from splitserve.launch.up import StackSettings, start_stack, wait_ready
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.harness import WORKER_ARGS, assert_nothing_leaks, gateway, stats, workers

pytestmark = pytest.mark.slow

LONG = SamplingParams(temperature=0, max_tokens=1200, ignore_eos=True)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str) -> str:
    """SERVING / NOT_SERVING, or the status code of a failed check (UNAVAILABLE: not up)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def reserve(address: str, request_id: str) -> worker_pb2.ReserveResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.DecodeWorkerStub(channel).Reserve(
            worker_pb2.ReserveRequest(
                request_id=request_id,
                prompt_token_ids=[5, 6, 7],
                sampling=convert.sampling_to_proto(LONG),
            ),
            timeout=5,
        )


@pytest.fixture(scope="module")
def started(tiny_models):
    """A stack (2 decode workers) and the health of decode-0 seen from its first moment on."""
    settings = StackSettings(
        model=str(tiny_models["llama"]), prefill=1, decode=2, extra_worker_args=WORKER_ARGS
    )
    stack = start_stack(settings, wait=False)
    try:
        address = f"127.0.0.1:{stack.ports['decode-0']}"
        seen: list[str] = []
        loading_reply = None
        deadline = time.monotonic() + 120
        while (not seen or seen[-1] != "SERVING") and time.monotonic() < deadline:
            status = health(address)
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == "NOT_SERVING" and loading_reply is None:
                try:
                    reserve(address, "too-early")
                except grpc.RpcError as err:
                    loading_reply = (err.code(), err.details())
            time.sleep(0.005)
        wait_ready(stack, settings)
        yield stack, seen, loading_reply
    finally:
        stack.stop()


def _running_request(stack, request_id: str):
    """Start a long request; return its future once its first tokens have arrived."""
    first = threading.Event()

    def run():
        responses = stream(gateway(stack), [5] * 30, LONG, request_id, timeout_s=120)
        head = next(responses)
        first.set()
        rest = collect(responses)
        return list(head.chunk.token_ids) + rest.token_ids[0], rest.finished

    pool = ThreadPoolExecutor(1)
    future = pool.submit(run)
    assert first.wait(60), "the request never started"
    pool.shutdown(wait=False)
    return future


def test_worker_health_is_not_serving_while_loading_then_serving(started):
    _, seen, loading_reply = started
    # Not listening yet, then up but loading, then ready.
    assert seen[-1] == "SERVING"
    assert "NOT_SERVING" in seen and seen.index("NOT_SERVING") < seen.index("SERVING"), seen
    assert set(seen) <= {"UNAVAILABLE", "DEADLINE_EXCEEDED", "NOT_SERVING", "SERVING"}
    if loading_reply is not None:  # a call that came in while loading was refused, not lost
        assert loading_reply == (grpc.StatusCode.UNAVAILABLE, "loading")


def test_sigterm_to_a_decode_worker_finishes_its_request_then_exits_0(started):
    stack = started[0]
    address = f"127.0.0.1:{stack.ports['decode-0']}"
    future = _running_request(stack, "drain-decode")  # idle workers tie: decode-0 gets it
    running = {w.worker_id for w in workers(stack) if w.kind == "decode" and stats(w).num_running}
    assert running == {"decode-0"}
    proc = stack.process("decode-0")
    assert len(reserve(address, "before-drain").destination.block_ids) == 1
    with grpc.insecure_channel(address) as channel:  # that reservation is not left behind
        worker_pb2_grpc.DecodeWorkerStub(channel).Abort(
            common_pb2.AbortRequest(request_id="before-drain"), timeout=5
        )
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while health(address) != "NOT_SERVING":
        assert time.monotonic() < deadline, "health never turned NOT_SERVING"
        time.sleep(0.01)
    assert not future.done(), "the request should still be running while the worker drains"
    with pytest.raises(grpc.RpcError) as refused:
        reserve(address, "after-drain")
    assert (refused.value.code(), refused.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "draining",
    )
    assert "decode-0" not in {w.worker_id for w in workers(stack)}, "still routable"
    # NOTE: still a KV peer while it drains: a push it makes or takes (a prefill into what was
    # reserved here) is vouched for by its endpoint (kv_transfer/presence.py)
    registry = Registry(stack.redis_url)
    assert registry.kv_endpoint("decode-0") is not None
    # A new request goes to the other decode worker meanwhile.
    other = collect(stream(gateway(stack), [7] * 10, SamplingParams(max_tokens=4), timeout_s=60))
    assert len(other.token_ids[0]) == 4
    tokens, finished = future.result(timeout=120)
    assert len(tokens) == LONG.max_tokens
    assert finished.usage.completion_tokens == LONG.max_tokens
    assert proc.wait(timeout=30) == 0
    stack.processes.remove(proc)
    assert registry.kv_endpoint("decode-0") is None  # it left for good when it stopped
    registry.close()
    assert_nothing_leaks(stack)


def test_sigterm_to_the_gateway_finishes_its_request_then_exits_0(started):
    stack = started[0]
    future = _running_request(stack, "drain-gateway")
    proc = stack.process("gateway")
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while health(stack.address) != "NOT_SERVING":
        assert time.monotonic() < deadline, "health never turned NOT_SERVING"
        time.sleep(0.01)
    assert not future.done(), "the request should still be running while the gateway drains"
    with pytest.raises(grpc.RpcError) as refused:
        collect(stream(gateway(stack), [7] * 10, SamplingParams(max_tokens=4), timeout_s=10))
    assert (refused.value.code(), refused.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "draining",
    )
    tokens, finished = future.result(timeout=120)
    assert len(tokens) == LONG.max_tokens
    assert finished.usage.completion_tokens == LONG.max_tokens
    assert proc.wait(timeout=30) == 0
    stack.processes.remove(proc)
    assert_nothing_leaks(stack)
