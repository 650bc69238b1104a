"""A tensor-parallel worker that loses one rank is a dead worker: SIGKILL of a decode worker's
follower rank (not its engine core, not its front) fails that engine with a clear error, the
worker leaves the registry, its streams move to the other decode worker and finish with the
tokens they would have had, and no block or Redis record is left anywhere."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

GATEWAY_ARGS = ("--stall-timeout-s", "2", "--rpc-timeout-s", "2", "--suspect-s", "60")
FOLLOWER = b"splitserve.engine.parallel.follower"


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            children = (task / "children").read_text().split()
            found += [int(c) for c in children]
            todo += [int(c) for c in children]
    return found


def _follower_pid(front_pid: int) -> int:
    """The tensor-parallel follower rank among a worker's descendant processes."""
    for pid in _descendants(front_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if FOLLOWER in cmdline:
            return pid
    raise AssertionError(f"worker {front_pid} has no tensor-parallel follower")


def test_killing_one_rank_of_a_tp2_decode_worker_is_a_dead_worker(tiny_models):
    model = tiny_models["llama"]
    prompts = random_prompts([20 + 3 * i for i in range(8)], 500, seed=77)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    outs = LLM(model).generate(prompts, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outs]
    with (
        running_stack(
            model, prefill=1, decode=2, kv_transport="grpc",
            extra_decode_args=("--tensor-parallel-size", "2"),
            extra_gateway_args=GATEWAY_ARGS,
        ) as stack,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):  # fmt: skip
        stub = gateway(stack)
        futures = [
            pool.submit(lambda p: collect(stream(stub, p, params, timeout_s=180)), p)
            for p in prompts
        ]
        decode_0 = next(w for w in workers(stack) if w.worker_id == "decode-0")
        deadline = time.monotonic() + 120
        while stats(decode_0, stack).num_running < 2:
            assert time.monotonic() < deadline, "decode-0 never ran 2 streams"
            time.sleep(0.01)
        front = stack.process("decode-0")
        os.kill(_follower_pid(front.pid), signal.SIGKILL)
        for done, want in zip((f.result(timeout=180) for f in futures), expected, strict=True):
            assert done.token_ids[0] == want
        assert front.wait(timeout=60) != 0  # the worker died with its rank
        deadline = time.monotonic() + 15
        while any(w.worker_id == "decode-0" for w in workers(stack)):
            assert time.monotonic() < deadline, "decode-0 is still in the registry"
            time.sleep(0.1)
        assert_nothing_leaks(stack)
