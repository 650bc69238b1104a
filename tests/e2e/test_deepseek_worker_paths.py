"""DeepSeek (MLA latent KV) on the worker paths beside the plain P/D push, real processes:
decode streams moved off a worker that changes role hand their latent blocks to the decode
worker that resumes them, and a prefix evicted from the prefill worker's pool comes back from
its host tier; greedy float32 tokens equal HF transformers' throughout, and nothing leaks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
from splitserve.roles.control import set_role
from splitserve.testing.tiny_deepseek import make_tiny_deepseek_model
from tests.e2e.harness import (
    assert_nothing_leaks,
    gateway,
    member_metadata,
    metric,
    running_stack,
    stats,
    workers,
)
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek_model(tmp_path_factory.mktemp("deepseek") / "v3", "deepseek_v3")


def _handoffs_sent(stack, worker) -> int:
    """A worker's hand-offs (its DecodeWorker stats, whatever its role now)."""
    with grpc.insecure_channel(worker.address) as channel:
        return (
            worker_pb2_grpc.DecodeWorkerStub(channel)
            .GetStats(worker_pb2.GetStatsRequest(), timeout=10, metadata=member_metadata(stack))
            .num_handoffs_sent
        )


def test_streams_moved_at_a_role_switch_hand_off_their_latents(deepseek_dir):
    prompts = random_prompts([40, 90, 17], 500, seed=61)
    with running_stack(deepseek_dir, prefill=1, decode=2, worker_args=("--role-switch",)) as stack:
        stub = gateway(stack)
        live = [w for w in workers(stack) if w.kind == "decode"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            running = [pool.submit(lambda p: collect(stream(stub, p, LONG, timeout_s=300)), p)
                       for p in prompts]  # fmt: skip
            deadline = time.monotonic() + 60
            while sum(stats(w, stack).num_running for w in live) < len(prompts):
                assert time.monotonic() < deadline, "the streams never ran"
                time.sleep(0.05)  # NOTE: the streams are decoding when the switch comes
            busiest = max(live, key=lambda w: stats(w, stack).num_running)
            other = next(w for w in live if w is not busiest)
            prefilled = stats(other, stack).num_prefill_tokens
            sent = _handoffs_sent(stack, busiest)
            secret = stack.secrets.cluster_secret if stack.secrets is not None else ""
            switched = set_role(busiest.address, busiest.worker_id, "prefill", secret, 0.05)
            results = [f.result() for f in running]
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids[0] == hf_greedy(deepseek_dir, tuple(prompt), LONG.max_tokens)
        # The moved streams took their latents along: the worker that resumed them computed
        # none of their prompts or tokens again.
        assert switched.num_streams_moved >= 1
        assert _handoffs_sent(stack, busiest) - sent == switched.num_streams_moved
        assert stats(other, stack).num_prefill_tokens == prefilled
        set_role(busiest.address, busiest.worker_id, "decode", secret, 0.0)
        assert_nothing_leaks(stack)


def test_an_evicted_prefix_comes_back_from_the_host_tier(deepseek_dir):
    shared = random_prompts([160], 500, seed=62)[0]
    others = random_prompts([200, 200], 500, seed=63)
    room = ("--num-kv-blocks", "24", "--max-model-len", "384", "--kv-host-cache-gb", "0.01")
    with running_stack(deepseek_dir, prefill=1, decode=1, worker_args=room, metrics=True) as stack:
        stub = gateway(stack)
        for prompt in [shared + [5], *others]:  # the others take the pool: shared is evicted
            collect(stream(stub, prompt, SHORT, timeout_s=60))
        before = metric(stack, "prefill-0", "splitserve:host_cache_hits_total")
        again = shared + [6]
        got = collect(stream(stub, again, SHORT, timeout_s=60)).token_ids[0]
        assert got == hf_greedy(deepseek_dir, tuple(again), SHORT.max_tokens)
        assert metric(stack, "prefill-0", "splitserve:host_cache_hits_total") - before >= 10
        assert_nothing_leaks(stack)
