"""A `--role-switch` worker changes role in place under load: no request is lost (every stream's
tokens equal the offline engine's), nothing is left behind, and it can switch back."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from splitserve.roles.control import set_role
from tests.e2e.harness import (
    assert_nothing_leaks,
    gateway,
    member_metadata,
    running_stack,
    stats,
    workers,
)
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# NOTE: long enough that all three still run when the switch comes, however loaded the host
LONG = SamplingParams(temperature=0, max_tokens=1200, ignore_eos=True)


def _secret(stack) -> str:
    return stack.secrets.cluster_secret if stack.secrets is not None else ""


def _switch(stack, worker_id: str, kind: str, drain_timeout_s: float = 0.0):
    worker = next(w for w in workers(stack) if w.worker_id == worker_id)
    return set_role(worker.address, worker_id, kind, _secret(stack), drain_timeout_s)


def _kinds(stack) -> dict[str, str]:
    return {w.worker_id: w.kind for w in workers(stack)}


@pytest.fixture(scope="module")
def model_and_expected(tiny_models):
    model_dir = tiny_models["llama"]
    prompts = random_prompts([5, 40, 90, 17, 130, 60, 8, 75], 400, seed=31)
    llm = LLM(model_dir)
    short = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    long = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], LONG, use_tqdm=False)]
    return model_dir, prompts, short, long


@pytest.fixture(scope="module")
def stack(model_and_expected):
    model_dir = model_and_expected[0]
    with running_stack(
        model_dir, prefill=1, decode=2, worker_args=("--role-switch",), metrics=True
    ) as s:
        yield s


def _suspicions(stack) -> float:
    """How many times the gateway took a worker for lost or silent (its /metrics)."""
    port = stack.metrics_ports["gateway"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "splitserve:worker_suspicions_total"
    )


def test_switch_under_load_loses_no_request_and_switching_back_restores_the_split(
    stack, model_and_expected
):
    _, prompts, expected, _ = model_and_expected
    stub = gateway(stack)
    before = _kinds(stack)
    assert sorted(before.values()) == ["decode", "decode", "prefill"]
    decode_id = sorted(k for k, v in before.items() if v == "decode")[0]
    with ThreadPoolExecutor(len(prompts) * 2) as pool:
        first = [pool.submit(lambda p: collect(stream(stub, p, GREEDY, timeout_s=120)), p)
                 for p in prompts]  # fmt: skip
        time.sleep(0.3)
        switched = _switch(stack, decode_id, "prefill", drain_timeout_s=30)
        second = [pool.submit(lambda p: collect(stream(stub, p, GREEDY, timeout_s=120)), p)
                  for p in prompts]  # fmt: skip
        results = [f.result() for f in first + second]
    assert (switched.previous_kind, switched.kind) == ("decode", "prefill")
    assert [r.token_ids[0] for r in results] == expected + expected
    assert sorted(_kinds(stack).values()) == ["decode", "prefill", "prefill"]
    back = _switch(stack, decode_id, "decode")
    assert (back.previous_kind, back.kind) == ("prefill", "decode")
    assert _kinds(stack) == before
    again = [collect(stream(stub, p, GREEDY, timeout_s=120)) for p in prompts[:3]]
    assert [r.token_ids[0] for r in again] == expected[:3]
    assert_nothing_leaks(stack)


def test_streams_running_at_the_drain_timeout_move_and_finish_with_the_same_tokens(
    stack, model_and_expected
):
    _, prompts, _, expected_long = model_and_expected
    stub = gateway(stack)
    decode_ids = sorted(k for k, v in _kinds(stack).items() if v == "decode")
    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(lambda p: collect(stream(stub, p, LONG, timeout_s=180)), p)
                   for p in prompts[:3]]  # fmt: skip
        live = [w for w in workers(stack) if w.worker_id in decode_ids]
        deadline = time.monotonic() + 60
        while sum(stats(w, stack).num_running for w in live) < 3:
            assert time.monotonic() < deadline, "the streams never ran"
            time.sleep(0.05)  # NOTE: the streams are decoding when the switch comes
        busiest = max(live, key=lambda w: stats(w, stack).num_running).worker_id
        switched = _switch(stack, busiest, "prefill", 0.05)
        results = [f.result() for f in running]
    assert [r.token_ids[0] for r in results] == expected_long
    assert switched.kind == "prefill"
    assert switched.num_streams_moved >= 1
    assert _suspicions(stack) == 0  # NOTE: a worker that hands its streams off is not lost
    _switch(stack, busiest, "decode")
    assert_nothing_leaks(stack)


def test_colocated_and_back_and_a_bad_role_is_refused(stack, model_and_expected):
    _, prompts, expected, _ = model_and_expected
    stub = gateway(stack)
    worker_id = sorted(k for k, v in _kinds(stack).items() if v == "decode")[1]
    assert _switch(stack, worker_id, "colocated").kind == "colocated"
    results = [collect(stream(stub, p, GREEDY, timeout_s=120)) for p in prompts[:4]]
    assert [r.token_ids[0] for r in results] == expected[:4]
    assert _switch(stack, worker_id, "decode").kind == "decode"
    worker = next(w for w in workers(stack) if w.worker_id == worker_id)
    from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(worker.address) as channel, pytest.raises(grpc.RpcError) as err:
        worker_pb2_grpc.WorkerRoleStub(channel).SetRole(
            worker_pb2.SetRoleRequest(kind=worker_pb2.WORKER_KIND_UNSPECIFIED),
            timeout=10,
            metadata=member_metadata(stack),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_nothing_leaks(stack)
