"""A worker holds as many streams as its engine admits, not as many as a thread pool has: 100
concurrent Generate streams through one prefill and one decode worker (gRPC KV transport) all
complete with every token, the decode worker runs more of them at once than the 64 threads each
server used to have, and nothing is left behind."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers

pytestmark = pytest.mark.slow

NUM_STREAMS = 100
OLD_THREAD_POOL = 64  # what every server's ThreadPoolExecutor had (a stream held a thread)
# NOTE: long enough that every stream is still decoding when the last one arrives, on a slow
# two-core machine too (at 16 tokens the first streams had finished: at most 60 ran at once).
PARAMS = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)


@pytest.mark.slow
def test_a_decode_worker_runs_more_concurrent_streams_than_a_64_thread_pool_allowed(tiny_models):
    args = ("--max-num-seqs", "128")
    with running_stack(
        tiny_models["llama"], prefill=1, decode=1, kv_transport="grpc", worker_args=args
    ) as stack:
        (decode,) = [w for w in workers(stack) if w.kind == "decode"]
        running: list[int] = []
        done = threading.Event()

        def watch() -> None:  # GetStats answers while every stream is open
            while not done.is_set():
                running.append(stats(decode).num_running)
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        stub = gateway(stack)
        prompts = [[5 + i % 50] * 8 for i in range(NUM_STREAMS)]
        try:
            with ThreadPoolExecutor(NUM_STREAMS) as pool:
                results = list(
                    pool.map(lambda p: collect(stream(stub, p, PARAMS, timeout_s=120)), prompts)
                )
        finally:
            done.set()
            watcher.join()
        assert len(results) == NUM_STREAMS
        for result in results:
            assert len(result.token_ids[0]) == PARAMS.max_tokens
            assert result.finished.usage.completion_tokens == PARAMS.max_tokens
            assert result.finished.usage.prompt_tokens == 8
        assert max(running) > OLD_THREAD_POOL, f"at most {max(running)} ran at once"
        assert_nothing_leaks(stack)
