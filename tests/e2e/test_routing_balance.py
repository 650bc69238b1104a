"""With nothing to reuse, the gateway spreads streams evenly over the decode workers.

Routing subtracts a cached-prefix bonus from each decode worker's load. When no prompt shares
a prefix with another (each differs from its first token), that bonus must be zero for every
worker and the choice pure least-loaded: neither worker may end up running clearly more
streams than the other. This guards against a bonus or tie-break that skews plain traffic.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

NUM_STREAMS = 48
# NOTE: long enough that the streams overlap for many samples on a slow two-core machine.
PARAMS = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
MAX_IMBALANCE = 1.3


def test_distinct_prompts_are_spread_evenly_over_two_decode_workers(tiny_models):
    """Each decode worker's in-flight streams (running, waiting and reserved: the load the
    router weighs, from the worker's own stats) are sampled during the run; each worker's peak
    is what routing gave it once every stream had arrived. The busier peak must be at most
    1.3x the other's, plus one stream (an odd split, or a stream that moved between the two
    workers' stats calls, is not a skew).

    NOTE: peaks, not sums over the run: once every stream is placed, how fast each worker's
    streams finish is its decode speed (two workers share two cores here: one fell behind
    and held 20 streams against 10), which routing cannot change for streams already placed."""
    prompts = random_prompts([24] * NUM_STREAMS, 500, seed=61)
    for i, prompt in enumerate(prompts):
        prompt[0] = 3 + i  # distinct first tokens: no two prompts share even one block
    args = ("--max-num-seqs", "64")
    # NOTE: no Reserve hedge: on a busy machine a burst's Reserves can take longer than the
    # hedge delay, and a hedge rightly moves a stream to whichever worker answers first. That
    # is failover, not routing; here the routing alone is checked.
    hedge = ("--reserve-hedge-s", "0")
    with running_stack(
        tiny_models["llama"], prefill=1, decode=2, worker_args=args, extra_gateway_args=hedge
    ) as stack:
        decode = [w for w in workers(stack) if w.kind == "decode"]
        assert len(decode) == 2
        samples: list[tuple[int, int]] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                found = [stats(w, stack) for w in decode]
                samples.append(
                    tuple(s.num_running + s.num_waiting + s.num_reservations for s in found)
                )
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        stub = gateway(stack)
        try:
            with ThreadPoolExecutor(NUM_STREAMS) as pool:
                results = list(
                    pool.map(lambda p: collect(stream(stub, p, PARAMS, timeout_s=180)), prompts)
                )
        finally:
            done.set()
            watcher.join()
        assert len(results) == NUM_STREAMS
        for result in results:
            assert result.finished is not None
            assert result.finished.usage.completion_tokens == PARAMS.max_tokens
        peaks = [max(s[i] for s in samples) for i in (0, 1)]
        # The streams overlapped: most were in flight at once (else there is nothing to balance).
        assert sum(peaks) >= NUM_STREAMS // 2, f"peaks {peaks} of {NUM_STREAMS} streams"
        assert max(peaks) <= MAX_IMBALANCE * min(peaks) + 1, f"in-flight peaks {peaks}"
        assert_nothing_leaks(stack)
