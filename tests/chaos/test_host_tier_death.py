"""A worker with a host-memory KV tier dies: both its prefix-index ids go, routing forgets it.

A worker publishes its GPU prefix cache under its id and its host tier under `<id>@host`. If
it is SIGKILLed (it and its engine core, as a lost host would be), nobody calls its `leave`:
only the survivors' sweep (every lease) clears it. A host-tier entry left behind would make
the gateway prefer a dead worker for every prompt it once held, so the test checks both ids
go within the sweep period, that a prompt the dead worker held is then served by a live one
with no retry, and that the survivors hold nothing afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.engine.prefix_hash import prefix_block_hashes
from splitserve.kv_transfer.registry import Registry
from splitserve.kv_transfer.registry_prefix import host_tier_id
from tests.chaos.test_worker_death import _engine_core_pid
from tests.e2e.harness import assert_nothing_leaks, gateway, metric, running_stack, stats, workers
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# NOTE: 24 blocks of 16 tokens hold one 200-token prompt and part of a second: the earlier
# prompts are evicted into the (10 MB) host tier, as in tests/e2e/test_host_tier_e2e.py.
ROOM = ("--num-kv-blocks", "24", "--max-model-len", "384", "--kv-host-cache-gb", "0.01")
VICTIM = "prefill-0"
# Heartbeat TTL (1.5 s) + one sweep period (the harness's --lease-s 3) + housekeeping slack.
SWEEP_WAIT_S = 15.0


def _wait(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not (last := check()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} within {timeout_s} s: {last!r}")
        time.sleep(0.1)


def test_a_killed_workers_gpu_and_host_prefix_entries_are_swept(tiny_models):
    prompts = random_prompts([200] * 4, 500, seed=91)
    hashes = [prefix_block_hashes(p, 16) for p in prompts]
    with running_stack(
        tiny_models["llama"], prefill=2, decode=1, worker_args=ROOM, metrics=True
    ) as stack:
        stub = gateway(stack)
        # NOTE: sent one at a time, each finds both prefill workers idle and uncached: the
        # tie goes to the lowest id, so prefill-0 prefills them all and evicts into its host.
        for prompt in prompts:
            collect(stream(stub, prompt, GREEDY, timeout_s=60))
        registry = Registry(stack.redis_url)
        try:

            def tiers() -> list[tuple[int, int]]:
                return [registry.prefix_match_tiers(h).get(VICTIM, (0, 0)) for h in hashes]

            _wait(
                lambda: any(t[0] > 0 for t in tiers()) and any(n > g for g, n in tiers()),
                10.0, f"{VICTIM} never listed blocks in both its GPU and host tiers",
            )  # fmt: skip
            # NOTE: the index's own keys, since `prefix_index_workers` folds `@host` into its id
            for index_id in (VICTIM, host_tier_id(VICTIM)):
                assert registry._client.exists(registry._prefix_worker_key(index_id)), index_id

            core = _engine_core_pid(stack.process(VICTIM).pid)
            # NOTE: the worker first: a worker that saw its core die could still leave cleanly
            os.kill(stack.process(VICTIM).pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):  # it may have exited with its worker
                os.kill(core, signal.SIGKILL)

            def swept() -> bool:
                held = [w for h in hashes for w in registry.prefix_match_tiers(h)]
                return VICTIM not in registry.prefix_index_workers() and VICTIM not in held

            _wait(swept, SWEEP_WAIT_S, f"{VICTIM}'s prefix entries (GPU or host) not swept")
            _wait(lambda: all(w.worker_id != VICTIM for w in workers(stack)), 10.0,
                  f"{VICTIM} still live in the registry")  # fmt: skip
        finally:
            registry.close()

        retries = metric(stack, "gateway", "splitserve:routing_decisions_total", reason="retry")

        # Prompt tokens computed or found in cache, by the live workers.
        def computed() -> int:
            found = [stats(w, stack) for w in workers(stack)]
            return sum(s.num_prefill_tokens + s.prefix_cache_hit_tokens for s in found)

        before = computed()
        got = collect(stream(stub, prompts[0], GREEDY, timeout_s=60)).token_ids[0]
        assert got == hf_greedy(tiny_models["llama"], tuple(prompts[0]), GREEDY.max_tokens)
        # No first try at the dead worker (a retry would count), and a live one did the work.
        assert metric(stack, "gateway", "splitserve:routing_decisions_total", reason="retry") == (
            retries
        )
        assert computed() > before
        assert_nothing_leaks(stack)
