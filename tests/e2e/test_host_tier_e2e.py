"""`--kv-host-cache-gb` through the disaggregated stack: a prompt whose prefix the prefill
worker's GPU cache has evicted is served from its host tier (its /metrics count the hit and
the bytes copied back), with HF transformers' greedy tokens; the registry's prefix index lists
the evicted prefix in that worker's host tier, for the gateway's routing."""

from __future__ import annotations

import time

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.engine.prefix_hash import prefix_block_hashes
from splitserve.kv_transfer.registry import Registry
from tests.e2e.harness import assert_nothing_leaks, gateway, metric, running_stack
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_an_evicted_prefix_comes_back_from_the_prefill_workers_host_tier(tiny_models):
    shared = random_prompts([160], 500, seed=31)[0]
    others = random_prompts([200, 200], 500, seed=32)
    first, again = shared + [5], shared + [6]
    room = ("--num-kv-blocks", "24", "--max-model-len", "384", "--kv-host-cache-gb", "0.01")
    with running_stack(
        tiny_models["llama"], prefill=1, decode=1, worker_args=room, metrics=True
    ) as stack:
        stub = gateway(stack)
        for prompt in [first, *others]:  # the others take the 24-block pool: shared is evicted
            collect(stream(stub, prompt, GREEDY, timeout_s=60))
        # Published on the worker's housekeeping turns: the prefix left its GPU, not its host
        registry = Registry(stack.redis_url)
        try:
            hashes = prefix_block_hashes(again, 16)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                tiers = registry.prefix_match_tiers(hashes).get("prefill-0", (0, 0))
                if tiers[1] == len(hashes) and tiers[0] < len(hashes):
                    break
                time.sleep(0.1)
            assert tiers[1] == len(hashes) and tiers[0] < len(hashes), tiers
        finally:
            registry.close()
        before = metric(stack, "prefill-0", "splitserve:host_cache_hits_total")
        got = collect(stream(stub, again, GREEDY, timeout_s=60)).token_ids[0]
        assert got == hf_greedy(tiny_models["llama"], tuple(again), GREEDY.max_tokens)
        assert metric(stack, "prefill-0", "splitserve:host_cache_hits_total") - before >= 10
        assert metric(stack, "prefill-0", "splitserve:host_cache_bytes_loaded_total") > 0
        assert metric(stack, "prefill-0", "splitserve:host_cache_blocks") > 0
        assert_nothing_leaks(stack)
