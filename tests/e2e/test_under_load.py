"""Under load the disaggregated path holds (real processes, real Redis): prefill queues longer
than a reservation's lease still complete every request; a decode worker whose KV pool or batch
is full queues prefilled requests (its `num_requests_waiting` moves) instead of failing them;
tokens equal the offline engine's and nothing is left behind."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _offline(model, prompts):
    llm = LLM(model)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _all(stack, prompts):
    stub = gateway(stack)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(lambda p: collect(stream(stub, p, PARAMS, timeout_s=300)), p)
            for p in prompts
        ]
        return [f.result().token_ids[0] for f in futures]


def test_prefill_queues_longer_than_the_lease_complete_every_request(tiny_models):
    model = tiny_models["llama"]
    prompts = random_prompts([1500] * 32, 500, seed=41)
    expected = _offline(model, prompts)
    # A 1 s lease, and a prefill worker that computes 64 tokens a step, given every request at
    # once: its queue holds 32 x 1500 tokens, several seconds of work.
    args = ("--lease-s", "1", "--max-num-batched-tokens", "64")
    gateway_args = ("--max-prefill-tokens-per-worker", "1000000")
    with running_stack(
        model, prefill=1, decode=1, worker_args=args, extra_gateway_args=gateway_args
    ) as stack:
        started = time.monotonic()
        assert _all(stack, prompts) == expected
        assert time.monotonic() - started > 3, "the queue must outlast the lease several times"
        (decode,) = [w for w in workers(stack) if w.kind == "decode"]
        assert stats(decode).num_reclaimed == 0, "no lease lapsed while its request queued"
        assert_nothing_leaks(stack)


def test_a_full_decode_worker_queues_prefilled_requests_instead_of_failing(tiny_models):
    model = tiny_models["llama"]
    prompts = random_prompts([150] * 16, 500, seed=42)
    expected = _offline(model, prompts)
    # The decode worker runs 2 sequences at a time and its pool holds about 4 requests' KV.
    args = ("--max-model-len", "512", "--num-kv-blocks", "48", "--max-num-seqs", "2")
    with running_stack(model, prefill=1, decode=1, worker_args=args) as stack:
        (decode,) = [w for w in workers(stack) if w.kind == "decode"]
        seen_waiting = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen_waiting.append(stats(decode).num_waiting)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert _all(stack, prompts) == expected
        finally:
            done.set()
            watcher.join()
        assert max(seen_waiting) > 0, "prefilled requests wait in the decode worker's queue"
        assert_nothing_leaks(stack)
