"""Routing prefills by what each prefill worker caches: prompts that share a long system
prompt go to the prefill worker that already holds it (its prefix index, published into the
registry like a decode worker's), so most system-prompt tokens come from cache, while both
prefill workers still take work."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.kv_transfer.registry import Registry
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

GROUPS, TURNS, SYSTEM = 6, 4, 256  # groups of prompts sharing a 256-token system prompt
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_shared_system_prompts_are_prefilled_where_they_are_cached(tiny_models):
    systems = random_prompts([SYSTEM] * GROUPS, 500, seed=41)
    questions = random_prompts([16] * (GROUPS * TURNS), 500, seed=42)
    with running_stack(tiny_models["llama"], prefill=2, decode=1) as stack:
        stub = gateway(stack)

        def group(g: int) -> None:
            for t in range(TURNS):
                prompt = systems[g] + questions[g * TURNS + t]
                assert len(collect(stream(stub, prompt, PARAMS, timeout_s=60)).token_ids[0]) == 4
                time.sleep(0.5)  # NOTE: the prefill worker publishes its cache every tick

        with ThreadPoolExecutor(GROUPS) as pool:
            list(pool.map(group, range(GROUPS)))
        prefill = [w for w in workers(stack) if w.kind == "prefill"]
        assert len(prefill) == 2
        found = [stats(w, stack) for w in prefill]
        hit = sum(s.prefix_cache_hit_tokens for s in found)
        # Ideal: every turn but a group's first finds its system prompt (16 of 256 tokens
        # per block boundary aside): (TURNS - 1) / TURNS of the system-prompt tokens.
        share = hit / (GROUPS * TURNS * SYSTEM)
        assert share >= 0.6, f"{share:.2f} of system-prompt tokens from cache"
        assert all(s.num_prefill_tokens > 0 for s in found), "one prefill worker did all"
        registry = Registry(stack.redis_url)
        try:
            indexed = registry.prefix_index_workers()
            assert {w.worker_id for w in prefill} <= indexed
        finally:
            registry.close()
        assert_nothing_leaks(stack)
