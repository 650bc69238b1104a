"""Role switches while streams run: workers flip between prefill and decode over and over (short
drains, so streams are moved mid-stream and prefills are refused mid-routing) under a load of
streams of many lengths; every stream still ends with the offline engine's tokens, and nothing
is left behind."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from splitserve.role_cli import set_role
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

# decode-0 and prefill-0 trade places and back: at every moment one prefill and one decode
# worker stay (decode-1 never moves).
FLIPS = [("decode-0", "prefill"), ("prefill-0", "decode"), ("prefill-0", "prefill"),
         ("decode-0", "decode")]  # fmt: skip


def _switch(stack, worker_id: str, kind: str, drain_timeout_s: float):
    secret = stack.secrets.cluster_secret if stack.secrets is not None else ""
    worker = next(w for w in workers(stack) if w.worker_id == worker_id)
    return set_role(worker.address, worker_id, kind, secret, drain_timeout_s)


def test_streams_survive_workers_flipping_roles_under_load(tiny_models):
    model_dir = tiny_models["llama"]
    prompts = random_prompts([7, 50, 120, 33, 90, 15, 200, 64, 11, 140, 28, 75], 400, seed=77)
    lengths = [40, 160, 120, 200, 60, 180, 90, 160, 30, 140, 120, 100]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm = LLM(model_dir)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # NOTE: flips every few hundred ms can hand one stream off more often than the default
    # --max-migrations (2) allows; the planner's dwell keeps real switches far apart.
    with running_stack(
        model_dir,
        prefill=1,
        decode=2,
        worker_args=("--role-switch",),
        extra_gateway_args=("--max-migrations", "8"),
    ) as stack:
        stub = gateway(stack)
        done = threading.Event()
        switches: list = []

        def flip() -> None:
            while not done.is_set():
                for worker_id, kind in FLIPS:
                    if done.is_set():
                        return
                    switches.append(_switch(stack, worker_id, kind, 0.1))

        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            flipper = pool.submit(flip)
            results = list(
                pool.map(
                    lambda job: collect(stream(stub, job[0], job[1], timeout_s=180)),
                    zip(prompts, params, strict=True),
                )
            )
            done.set()
            flipper.result()
        assert [r.token_ids[0] for r in results] == expected
        assert len(switches) >= 4
        assert sum(s.num_streams_moved for s in switches) >= 1
        kinds = {w.worker_id: w.kind for w in workers(stack)}
        if kinds["decode-0"] != "decode":
            _switch(stack, "decode-0", "decode", 0.1)
        if kinds["prefill-0"] != "prefill":
            _switch(stack, "prefill-0", "prefill", 0.1)
        assert_nothing_leaks(stack)
